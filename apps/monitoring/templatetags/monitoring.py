"""``{% nic_correlation workload job %}``: NIC counters next to the slow ranks and links of an analysis result."""

from __future__ import annotations

from typing import Any

from django import template

from ..selectors import analysis_subjects, nic_correlation

register = template.Library()


@register.inclusion_tag("monitoring/_nic_correlation.html")
def nic_correlation_for(workload: Any, job: Any) -> dict[str, Any]:
    subjects = analysis_subjects(job.kind, job.result)
    return {
        "correlation": nic_correlation(workload, subjects, workload.first_ns, workload.last_ns),
        "workload": workload,
    }
