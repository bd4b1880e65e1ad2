"""``torchrun`` with the baseline handler registered as ``--rdzv-backend=etcd-blob``.

    python benchmarks/workers/torchrun_blob.py --rdzv-backend=etcd-blob ... script.py args
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import blob_handler  # noqa: E402
from torch.distributed.run import main  # noqa: E402

if __name__ == "__main__":
    blob_handler.register()
    main()
