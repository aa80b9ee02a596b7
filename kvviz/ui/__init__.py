"""Streamlit pages and widgets (the only package, with app.py, that imports streamlit)."""
