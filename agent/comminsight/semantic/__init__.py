"""The semantic engine: training steps recovered from communication alone (docs/semantic.md).

The names below are imported from their modules on first use (PEP 562): the straggler analysis
imports ``comminsight.semantic.matching`` and ``roles`` alone, without the engine, the step recovery
and the templates, which a trace with step labels never needs.
"""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from comminsight.semantic.engine import CheckpointError, StepEngine
    from comminsight.semantic.steps import (
        StepCalibration,
        StepReport,
        agreement_with_labels,
        load_calibration,
        prepare_events,
        recover_steps,
        save_calibration,
    )
    from comminsight.semantic.templates import (
        Template,
        TemplateError,
        builtin_templates,
        load_template,
        parse_template,
    )

_MODULE_OF = {
    "CheckpointError": "engine",
    "StepEngine": "engine",
    "StepCalibration": "steps",
    "StepReport": "steps",
    "agreement_with_labels": "steps",
    "load_calibration": "steps",
    "prepare_events": "steps",
    "recover_steps": "steps",
    "save_calibration": "steps",
    "Template": "templates",
    "TemplateError": "templates",
    "builtin_templates": "templates",
    "load_template": "templates",
    "parse_template": "templates",
}

__all__ = [
    "CheckpointError",
    "StepCalibration",
    "StepEngine",
    "StepReport",
    "Template",
    "TemplateError",
    "agreement_with_labels",
    "builtin_templates",
    "load_calibration",
    "load_template",
    "parse_template",
    "prepare_events",
    "recover_steps",
    "save_calibration",
]


def __getattr__(name: str) -> Any:
    module = _MODULE_OF.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(import_module(f"{__name__}.{module}"), name)
    globals()[name] = value  # the next lookup is an ordinary attribute
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
