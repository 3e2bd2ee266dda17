"""An LLM stage's vLLM engine statistics, kept in the stage's own Prometheus registry.

vLLM's ``LLMEngine`` hands every step's ``SchedulerStats`` and ``IterationStats`` to its stat
loggers; its ``PrometheusStatLogger`` turns them into the ``vllm:`` series that ``vllm serve``
exports. That logger registers its metrics in prometheus_client's process-wide registry and
first unregisters every ``vllm:`` metric found there, so two engines in one process (two LLM
stages inline) would erase each other's series. :func:`stage_stat_logger` gives each stage a
subclass whose metrics live in a registry of the stage's own; :func:`collect_families` reads it
as plain :class:`~vllm_omni.stats.MetricFamily` objects (what crosses to the server).
"""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from vllm.distributed.ec_transfer.ec_connector.metrics import ECConnectorProm
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorProm
from vllm.v1.metrics.loggers import PrometheusStatLogger
from vllm.v1.metrics.perf import PerfMetricsProm
from vllm.v1.spec_decode.metrics import SpecDecodingProm

from vllm_omni.engine.vllm_adapter_names import public_adapter_name
from vllm_omni.stats import MetricFamily


def _bound(metric_cls: type[Any], registry: CollectorRegistry) -> type:
    """``metric_cls`` registering into ``registry`` whatever registry its caller names."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs["registry"] = registry if kwargs.get("_labelvalues") is None else None
        metric_cls.__init__(self, *args, **kwargs)

    return type(metric_cls.__name__, (metric_cls,), {"__init__": __init__})


def stage_stat_logger(registry: CollectorRegistry) -> type[PrometheusStatLogger]:
    """A ``PrometheusStatLogger`` class (pass it in ``LLMEngine``'s ``stat_loggers``) whose
    metrics, its helpers' included (speculative decoding, KV / EC connectors, performance),
    register in ``registry``. Being a ``PrometheusStatLogger``, it replaces vLLM's default one."""
    classes = {"_gauge_cls": Gauge, "_counter_cls": Counter, "_histogram_cls": Histogram}
    bound = {name: _bound(cls, registry) for name, cls in classes.items()}
    helpers = {
        "_spec_decoding_cls": SpecDecodingProm,
        "_kv_connector_cls": KVConnectorProm,
        "_ec_connector_cls": ECConnectorProm,
        "_perf_metrics_cls": PerfMetricsProm,
    }
    attrs: dict[str, Any] = dict(bound)
    for name, helper in helpers.items():
        attrs[name] = type(helper.__name__, (helper,), {k: v for k, v in bound.items() if hasattr(helper, k)})
    return type("OmniStagePrometheusStatLogger", (PrometheusStatLogger,), attrs)


def collect_families(registry: CollectorRegistry) -> list[MetricFamily]:
    """The families in ``registry`` now, as plain data (sample values as floats)."""
    return [
        MetricFamily(
            fam.name,
            fam.type,
            fam.documentation,
            [(s.name, dict(s.labels), float(s.value)) for s in fam.samples],
        )
        for fam in registry.collect()
    ]


#: Labels of vLLM's ``vllm:lora_requests_info`` that list adapters by the name the stage gave vLLM.
_ADAPTER_LIST_LABELS = ("running_lora_adapters", "waiting_lora_adapters")


def public_lora_families(families: list[MetricFamily]) -> list[MetricFamily]:
    """``families`` with the adapter lists of ``vllm:lora_requests_info`` (comma-separated names, one
    sample per distinct label set, valued with the time it was last seen) in clients' names: two
    versions of one adapter are one name, and samples whose labels then coincide are one (the latest)."""
    out = []
    for fam in families:
        if fam.name != "vllm:lora_requests_info":
            out.append(fam)
            continue
        merged: dict[tuple, tuple[str, dict[str, str], float]] = {}
        for sample, labels, value in fam.samples:
            labels = dict(labels)
            for key in _ADAPTER_LIST_LABELS:
                if labels.get(key):
                    names = (public_adapter_name(n) for n in labels[key].split(","))
                    labels[key] = ",".join(dict.fromkeys(names))
            merged_key = (sample, tuple(sorted(labels.items())))
            if merged_key not in merged or merged[merged_key][2] < value:
                merged[merged_key] = (sample, labels, value)
        out.append(MetricFamily(fam.name, fam.kind, fam.help, list(merged.values())))
    return out
