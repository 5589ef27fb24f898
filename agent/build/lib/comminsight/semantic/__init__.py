"""The semantic engine: training steps recovered from communication alone (docs/semantic.md)."""

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
from comminsight.semantic.templates import Template, TemplateError, builtin_templates, load_template, parse_template

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
