"""The didactic tree (CaSP paper Section 4.3): thin entry point; the logic is megatron_rlvr/inspection/toy_tree.py.

python tools/reports/toy_tree.py [--sweep] [--seeds 0 1 2] [--plot outputs/toy_tree.png]
"""

import sys

from megatron_rlvr.inspection.toy_tree import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
