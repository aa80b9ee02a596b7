"""Session state and what the app keeps beside it: the one door to st.session_state (session.py),
kept widget values, the model menu, the shared model loader, the run store."""
