"""scaletrain: plan, run, watch and recover distributed LLM training.

The Python API (api.py, docs/api.md): load_config, plan, train, evaluate. Importing the
package changes nothing in the process (its environment, PATH, the collector) and imports
neither torch nor pydantic; the functions import what they run when called.
"""

from scaletrain.api import RunSummary, evaluate, load_config, plan, train
from scaletrain.errors import UserError

__version__ = "0.1.0"

__all__ = ["RunSummary", "UserError", "__version__", "evaluate", "load_config", "plan", "train"]
