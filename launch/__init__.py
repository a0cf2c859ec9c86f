"""nemo-run launchers: `train.py`, `eval.py`, `convert.py` (scripts), `executors.py` (local torchrun and Slurm
H200), `recipes.py` (find, load and validate configs/ recipes), `shipping.py` (files carried into Slurm jobs)."""
