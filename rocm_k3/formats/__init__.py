"""K3's chat formats, below the engine: the K3 XTML renderer and the K2-style (Kimi Linear) Jinja renderer, their
output parsers (:mod:`rocm_k3.formats.parsers`, whole and streaming) and tool-schema helpers.

Imported by the entrypoints, the engine, structured output, the worker and training alike; it imports only
:mod:`rocm_k3.tokenizers` and the standard library (and jinja2). :func:`load_chat_renderer` chooses the format of a
checkpoint directory."""

from rocm_k3.formats.chat_base import ChatRenderer, RenderedChat, ThinkingOptions, thinking_options
from rocm_k3.formats.k2_chat import CHAT_TEMPLATE_FILE, K2ChatRenderer
from rocm_k3.formats.k3_chat import K3ChatRenderer
from rocm_k3.formats.loader import load_chat_renderer

__all__ = [
    "CHAT_TEMPLATE_FILE", "ChatRenderer", "K2ChatRenderer", "K3ChatRenderer", "RenderedChat", "ThinkingOptions",
    "load_chat_renderer", "thinking_options",
]
