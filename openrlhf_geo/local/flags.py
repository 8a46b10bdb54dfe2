"""The command-line parser of `openrlhf-geo train`, `demo` and `study`: one-line errors, close matches for typos."""

import argparse
import difflib


class FlagParser(argparse.ArgumentParser):
    """argparse whose errors are ValueError (one line, no usage dump) and whose unknown flags get a close match."""

    def error(self, message):
        raise ValueError(message)

    def parse_args(self, args=None, namespace=None):
        namespace, extras = self.parse_known_args(args, namespace)
        if extras:
            flags = [s for action in self._actions for s in action.option_strings]
            unknown = next((x.split("=")[0] for x in extras if x.startswith("-")), None)
            close = []
            if unknown:  # the same last part under another group (--diagnostics.dim -> --salt.dim), else spelling
                close = [f for f in flags if f.split(".")[-1] == unknown.split(".")[-1] and "." in unknown]
                close = close or difflib.get_close_matches(unknown, flags, n=1)
            hint = f" (did you mean {' or '.join(close[:3])}?)" if close else ""
            self.error(f"unrecognized arguments: {' '.join(extras)}{hint}")
        return namespace
