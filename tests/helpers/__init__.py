"""What several test files share: `helpers.world` (processes, ranks, deadlines) and `helpers.models`
(models, data, comparisons). pytest puts tests/ on the path (pyproject.toml), so a test imports
`from helpers.world import run_world` wherever it lives."""
