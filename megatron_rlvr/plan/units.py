"""The units the memory plan counts in: GB as it prints them (10^9 bytes) and the bytes of one fp32 value."""

GB = 1e9
FP32 = 4
