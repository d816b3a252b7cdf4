"""The closing protocol shared by Context and Sequence: close() is idempotent, `with` closes, and garbage
collection closes what the user forgot (never raising from __del__)."""


class Resource:
    def close(self):  # pragma: no cover - overridden
        raise NotImplementedError

    def __enter__(self):
        return self

    def __exit__(self, *exc_info):
        self.close()

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass
