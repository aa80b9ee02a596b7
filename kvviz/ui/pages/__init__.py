"""The app's pages, one folder each: a page's function and the parts only it uses."""
