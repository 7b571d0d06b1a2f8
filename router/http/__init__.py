"""HTTP/1.1 on trio (requests and worker responses parsed by llhttp): the native server loop and the upstream connection pool."""

from router.http.server.messages import ClientDisconnected, Handler, Request, ResponseWriter

__all__ = ["ClientDisconnected", "Handler", "Request", "ResponseWriter"]
