"""The documentation's own tooling: the generated tables and figures (`fill`), the reference pages built at every
site build (`reference`, `protodoc`, through `mkdocs_hooks`), and the pictures and notebook outputs made against a
real worker (`viewer_picture`, `notebook`).  Run as `python -m docs.tools.NAME`; mkdocs.yml leaves this folder out of
the site."""
