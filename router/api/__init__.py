"""The API surface: the routes table, the one error tree of answers the client is told, and each API's error shape."""
