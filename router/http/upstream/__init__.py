"""The upstream pool: HTTP/1.1 to the workers, one bounded LIFO idle deque per worker, responses parsed by llhttp behind our checks."""
