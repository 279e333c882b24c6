"""A short fuzzing campaign (campaign.py): every RPC and stream fed generated and
mutated messages for 20 s next to a valid engine. Nothing answers INTERNAL or UNKNOWN,
no traceback or error line is logged, the valid engine sees 0 byte mismatches and
CheckInvariants stays clean. `make fuzz MINUTES=n` runs it longer."""

from tests.fuzz.campaign import Campaign, methods, report

SECONDS = 20


def test_short_fuzz_campaign():
    figures = Campaign(seed=1).run(SECONDS)
    text = report(figures)
    print(text)
    assert figures.clean, text
    assert figures.pages_verified > 0 and figures.invariant_checks >= 2, text
    tried = {name for name, _ in figures.tried}
    assert tried == {m.name for m in methods()}, f"not every method was fuzzed: {text}"
