"""A short fuzz run: schemathesis generates requests for every operation in `/openapi.json` (fixed seed, a
bounded number of cases each) against the shared server; none may get a 5xx."""
from __future__ import annotations

import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from schemathesis.checks import not_a_server_error

CASES_PER_OPERATION = 6


def test_no_server_errors(server):
    schema = schemathesis.openapi.from_url(f"{server.url}/openapi.json")
    operations = [result.ok() for result in schema.get_all_operations()]
    assert len(operations) >= 8  # the OpenAI and utility routes of the shared server
    statuses: list[int] = []
    for operation in operations:
        @given(case=operation.as_strategy())
        @settings(max_examples=CASES_PER_OPERATION, derandomize=True, deadline=None, database=None,
                  phases=[Phase.explicit, Phase.generate], suppress_health_check=list(HealthCheck))
        def fuzz(case) -> None:
            response = case.call_and_validate(base_url=server.url, headers=server.headers,
                                              checks=[not_a_server_error], timeout=60)
            statuses.append(response.status_code)

        fuzz()
    assert len(statuses) >= 2 * len(operations)  # the cases really reached the server
    assert any(s < 300 for s in statuses) and any(400 <= s < 500 for s in statuses)
