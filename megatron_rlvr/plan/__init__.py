"""`megatron-rlvr plan`: per-GPU memory of a recipe's layout, predicted before a job is queued.

``memory`` holds the arithmetic (pure functions of the config and the model's HF config), ``suggest`` the search
over layouts, ``command`` the command line, ``recipe_files`` where recipes and model configs are found.
"""
