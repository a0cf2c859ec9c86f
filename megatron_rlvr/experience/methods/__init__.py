"""The algorithms that change a step's experience, one module each, each registering its transform with
`experience.transforms.experience_transform` (docs/extending.md):

- `armor`: ARMOR's anchors, a correct sample of the reference in each group;
- `demonstrations`: SFT on the prompts' reference solutions;
- `ground_truth`: ground-truth injection, the prompt's reference solution as one member of each group;
- `pba`: PBA's per-response KL coefficients from the base model's evidence.

The registry imports every module of this package when it is first read: a new method is a new module here, and
nothing in this file or in the loop names it.
"""
