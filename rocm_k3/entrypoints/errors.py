"""How the ``rocm-k3`` command reports an error: one line naming the problem and, where there is one, the fix.

:func:`describe` turns an exception into that line; ``rocm_k3.cli.main`` prints it and exits with status 2
(``--debug`` or ``ROCM_K3_LOG_LEVEL=debug`` show the traceback instead). An exception that is not one of the
named errors below is reported as an internal error with its class name.
"""

from __future__ import annotations

from rocm_k3.checkpoint_errors import CheckpointError
from rocm_k3.model.config import ConfigError
from rocm_k3.tokenizers import TokenizerError
from rocm_k3.ops.registry import BackendError

EXIT_ERROR = 2
EXIT_INTERRUPTED = 130

# top-level module -> the pyproject extra that installs it (`rocm-k3 serve` / `pd-proxy` without the server extra)
EXTRA_OF_MODULE: dict[str, str] = {"fastapi": "serve", "starlette": "serve", "uvicorn": "serve",
                                   "pydantic": "serve", "prometheus_client": "serve", "xgrammar": "serve",
                                   "jsonschema": "serve"}


def describe(exc: BaseException) -> str:
    """One line: what went wrong and how to fix it."""
    message = " ".join(str(exc).split()) or type(exc).__name__
    missing = (exc.name or "").partition(".")[0] if isinstance(exc, ModuleNotFoundError) else ""
    if missing in EXTRA_OF_MODULE:
        extra = EXTRA_OF_MODULE[missing]
        return f"{missing} is not installed; install the {extra} extra: pip install 'rocm-k3[{extra}]'"
    if isinstance(exc, BackendError):
        return (f"{message}; choose a backend that runs here with --backend (`rocm-k3 ops` shows what each op "
                "resolves to on this machine) or leave it unset to pick automatically")
    if isinstance(exc, (ConfigError, CheckpointError, TokenizerError)):
        return f"{message}; the checkpoint cannot be served as it is (fix or re-download the file named)"
    if isinstance(exc, OSError) and exc.filename is not None and exc.strerror:
        where = exc.filename if exc.filename2 is None else f"{exc.filename} -> {exc.filename2}"
        return f"{where}: {exc.strerror}; check the path and its permissions"
    if isinstance(exc, (ValueError, TypeError, OSError)):
        return message
    return f"internal error: {type(exc).__name__}: {message} (rerun with --debug for the traceback)"
