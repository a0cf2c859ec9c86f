"""nemo-run launchers: `train.py`, `eval.py`, `convert.py` (scripts), `options.py` (the checked launch options),
`executors.py` (local torchrun and Slurm H200, and the runner), `slurm_local.py` (the local Slurm CPU cluster),
`recipes.py` (find, load and validate configs/ recipes), `shipping.py` (files carried into Slurm jobs)."""
