import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))  # tests/checkpoints.py
os.environ.setdefault("SPECRAY_CACHE", str(Path(__file__).resolve().parent.parent / ".cache" / "specray"))
