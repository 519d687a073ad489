"""Read values back from prometheus-client metrics: what a process serves at ``/metrics``
is also what it reports elsewhere (the conductor's ``ClusterStatus`` totals, the router's
dashboard), so the two cannot disagree."""
from __future__ import annotations

from prometheus_client.metrics import MetricWrapperBase


def samples(metric: MetricWrapperBase, suffix: str = "_total"
            ) -> list[tuple[dict[str, str], float]]:
    """(labels, value) of every child's sample named ``<name><suffix>`` (``_total`` of a
    counter; ``_count`` or ``_sum`` of a histogram)."""
    return [(s.labels, s.value) for family in metric.collect() for s in family.samples
            if s.name.endswith(suffix)]


def by_label(metric: MetricWrapperBase, label: str, suffix: str = "_total"
             ) -> dict[str, float]:
    """Values summed per value of ``label`` (over the other labels)."""
    out: dict[str, float] = {}
    for labels, value in samples(metric, suffix):
        out[labels[label]] = out.get(labels[label], 0.0) + value
    return out


def total(metric: MetricWrapperBase, suffix: str = "_total") -> float:
    """The sum over every child."""
    return sum(value for _, value in samples(metric, suffix))
