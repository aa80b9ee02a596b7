"""kvviz: entry point. Page config and navigation only; pages live in kvviz/ui/."""
import streamlit as st

import kvviz

st.set_page_config(page_title="kvviz", layout="wide")
st.title("kvviz")
prompt = st.text_area("Prompt", "ROMEO:", key="prompt")
n = st.number_input("max_new_tokens", 1, 256, 64, key="max_new_tokens")
if st.button("Generate", key="generate"):
    try:
        run = kvviz.generate(kvviz.load_model("random:tiny"), prompt=prompt, max_new_tokens=int(n))
        with st.container(key="output"):
            st.text(run.text)
    except kvviz.KVVizError as e:
        st.error(str(e))
