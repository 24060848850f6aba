"""A bounded schemathesis run against the gateway's own /openapi.json: whatever it generates,
the gateway never answers 5xx (a fixed example budget and seed, so the run is bounded)."""

from __future__ import annotations

import pytest

schemathesis = pytest.importorskip("schemathesis")
from hypothesis import HealthCheck, Phase, given, settings  # noqa: E402

EXAMPLES = 100  # per operation; 10 operations


@pytest.fixture(scope="module")
def gw(start_gateway_module, vllm_worker_module):
    return start_gateway_module([vllm_worker_module.url])


def test_no_5xx_for_generated_requests(gw):
    schema = schemathesis.openapi.from_url(gw.url + "/openapi.json")
    failures: list[str] = []
    cases = 0
    for operation in schema.get_all_operations():
        op = operation.ok()

        @settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
                  phases=[Phase.explicit, Phase.generate],
                  suppress_health_check=list(HealthCheck))
        @given(case=op.as_strategy())
        def run(case) -> None:
            nonlocal cases
            cases += 1
            response = case.call(base_url=gw.url, timeout=30)
            if response.status_code >= 500:
                failures.append(f"{case.method} {case.formatted_path} -> "
                                f"{response.status_code}: {response.text[:200]}")

        run()
    print(f"schemathesis: {cases} cases, {len(failures)} 5xx")
    assert cases >= 300
    assert not failures, failures[:5]
