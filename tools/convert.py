#!/usr/bin/env python
"""HF <-> Megatron checkpoint conversion; see megatron_rlvr/bridge/convert.py (also `megatron-rlvr convert`)."""

import sys

if __name__ == "__main__":  # dist checkpointing may spawn helper processes: they must not re-run the conversion
    from megatron_rlvr.runtime.console import quiet_import_warnings

    quiet_import_warnings()  # as `megatron-rlvr convert` does: megatron-core's import-time notes on CPU
    from megatron_rlvr.bridge.convert import main

    sys.exit(main())
