"""``python -m bench``: the same as ``python bench/run.py`` (same options)."""

import runpy
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))  # the scripts import each other by name, as when run as files
runpy.run_path(str(HERE / "run.py"), run_name="__main__")
