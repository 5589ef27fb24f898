"""``{% analysis_section workload %}``: the Analysis card on the workload page (run buttons, recent jobs)."""

from __future__ import annotations

from typing import Any

from django import template

from ..models import AnalysisKind
from ..selectors import workload_jobs

register = template.Library()


@register.inclusion_tag("analysis/section.html", takes_context=True)
def analysis_section(context: template.Context, workload: Any) -> dict[str, Any]:
    # The caller already resolved ``workload`` through workloads_visible_to (the detail page).
    return {
        "workload": workload,
        "jobs": workload_jobs(workload)[:10],
        "kinds": AnalysisKind.choices,
        "csrf_token": context.get("csrf_token"),
    }
