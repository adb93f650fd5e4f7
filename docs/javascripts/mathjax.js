// MathJax 2 configuration for pymdownx.arithmatex (generic mode): \( \) inline, \[ \] display.
// MathJax itself is served by the site (assets/mathjax/, copied from the jupyter-server-mathjax
// package by docs/_hooks/offline.py); the SVG output needs no web fonts, so nothing is loaded
// from the internet.
window.MathJax = {
  jax: ["input/TeX", "output/SVG"],
  extensions: ["tex2jax.js"],
  TeX: {extensions: ["AMSmath.js", "AMSsymbols.js", "noErrors.js", "noUndefined.js"]},
  tex2jax: {
    inlineMath: [["\\(", "\\)"]],
    displayMath: [["\\[", "\\]"]],
    processEscapes: true,
    processEnvironments: true,
    ignoreClass: ".*",
    processClass: "arithmatex",
  },
  SVG: {font: "TeX"},
  showMathMenu: false,
  messageStyle: "none",
};

// Material's instant navigation swaps the page without reloading: typeset the new content.
if (typeof document$ !== "undefined") {
  document$.subscribe(() => {
    if (window.MathJax && window.MathJax.Hub) {
      window.MathJax.Hub.Queue(["Typeset", window.MathJax.Hub]);
    }
  });
}
