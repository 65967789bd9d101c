"""Makes the shared test kit (``agentflow_testkit``) importable under pytest's importlib mode."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
