# Type stub for the compiled core (csrc/bindings/module.cc); its names are
# used through the typed Python wrappers, so they are left as Any here.
from typing import Any

def __getattr__(name: str) -> Any: ...
