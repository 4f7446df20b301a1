"""Kubernetes resource quantities (64Gi, 500M, 1.5e9, 250m) as numbers, the way the API server reads
them. A few lines rather than the Kubernetes client's `parse_quantity`, because `orbit validate` and
`orbit plan` run where only Orbit's base dependencies are installed; a test checks that both agree.
"""

from __future__ import annotations

import re
from decimal import Decimal, InvalidOperation

BINARY = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50, "Ei": 2**60}
DECIMAL = {"n": Decimal("1e-9"), "u": Decimal("1e-6"), "m": Decimal("1e-3"), "": Decimal(1), "k": Decimal(10**3),
           "M": Decimal(10**6), "G": Decimal(10**9), "T": Decimal(10**12), "P": Decimal(10**15), "E": Decimal(10**18)}  # fmt: skip
FORM = re.compile(r"^([+-]?(?:[0-9]+\.?[0-9]*|\.[0-9]+))(Ki|Mi|Gi|Ti|Pi|Ei|[eE][+-]?[0-9]+|[numkMGTPE])?$")


def parse_quantity(text: str) -> Decimal:
    """TEXT as a number (bytes for memory); ValueError if it is not a Kubernetes quantity."""
    match = FORM.match(str(text).strip())
    if match is None:
        raise ValueError(f"{text!r} is not a Kubernetes quantity (e.g. 64Gi, 500M, 8)")
    number, suffix = match.group(1), match.group(2) or ""
    try:
        value = Decimal(number)
    except InvalidOperation:
        raise ValueError(f"{text!r} is not a Kubernetes quantity") from None
    if suffix in BINARY:
        return value * BINARY[suffix]
    if len(suffix) > 1 and suffix[0] in "eE":  # an exponent; a lone E is exa
        return value * Decimal(10) ** int(suffix[1:])
    return value * DECIMAL[suffix]
