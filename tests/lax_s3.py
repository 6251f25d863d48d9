"""moto's S3 server with conditional writes ignored: If-None-Match is dropped before moto sees
it, as many S3-compatible servers do. The tests point the checkpoint writer at it to show that
the etcd transaction, not the store, fences stale writers.

usage: python lax_s3.py HOST PORT
"""
import sys

from moto.server import DomainDispatcherApplication, MotoRequestHandler, create_backend_app
from werkzeug.serving import run_simple

app = DomainDispatcherApplication(create_backend_app)


def lax(environ, start_response):
    environ.pop("HTTP_IF_NONE_MATCH", None)
    return app(environ, start_response)


run_simple(sys.argv[1], int(sys.argv[2]), lax, threaded=True, request_handler=MotoRequestHandler)
