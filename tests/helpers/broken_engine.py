"""An engine module that does not import (a dependency it needs is missing): for the named-error test."""

import opsd_no_such_dependency  # noqa: F401


class Engine:
    pass
