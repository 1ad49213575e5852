"""A mapping node of a config as a plain ``dict`` (``OmegaConf.to_container``)."""

from __future__ import annotations

from typing import Any

from omegaconf import DictConfig, OmegaConf


def config_dict(node: DictConfig, *, resolve: bool = False) -> dict[Any, Any]:
    """The plain data of a mapping node.

    Args:
        node: A mapping node of a config.
        resolve: Whether to resolve interpolations.

    Returns:
        Its content as nested dicts and lists (keys as in the config: YAML's are
        strings, OmegaConf admits some other scalars).

    Raises:
        TypeError: If the node is not a mapping.
    """
    data = OmegaConf.to_container(node, resolve=resolve)
    if not isinstance(data, dict):
        raise TypeError(f"Expected a mapping node, got {type(data).__name__}.")
    return data
