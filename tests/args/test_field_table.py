"""docs/trainer.md's field table is the arguments' own help: stale when a field, a default or a help line changes."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from ddpkit.args import field_table
from ddpkit.args.training_args import TrainingArguments

PAGE = Path(__file__).parent.parent.parent / "docs" / "trainer.md"


def test_the_manuals_field_table_is_the_arguments_help():
    page = PAGE.read_text(encoding="utf-8")
    assert field_table.with_table(page) == page, (
        "docs/trainer.md's field table is stale: run `python -m ddpkit.args.field_table docs/trainer.md`")


def test_the_table_has_a_row_per_field_with_its_default_and_help():
    table = field_table.markdown_table().splitlines()
    fields = dataclasses.fields(TrainingArguments)
    assert len(table) == 2 + len(fields)
    row = next(line for line in table if line.startswith("| `learning_rate` |"))
    assert "`5e-05`" in row and TrainingArguments.__dataclass_fields__["learning_rate"].metadata["help"][:20] in row


def test_a_page_without_markers_is_refused_and_left_whole(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("# A page\n\nno table here\n")
    try:
        field_table.main([str(page)])
    except ValueError as error:
        assert "field table markers" in str(error)
    else:
        raise AssertionError("a page without markers was taken")
    assert page.read_text() == "# A page\n\nno table here\n"
