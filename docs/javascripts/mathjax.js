// MathJax 2 configuration for pymdownx.arithmatex (generic mode): \( \) inline, \[ \] display.
//
// MathJax is served by the site itself (assets/mathjax/, copied from the jupyter-server-mathjax
// package by docs/_hooks/offline.py), so nothing is loaded from the internet. That package ships
// a trimmed MathJax 2.7: the combined configuration TeX-AMS-MML_HTMLorMML-full (which holds the
// TeX input and the HTML-CSS output jax), and the STIX-Web fonts of the HTML-CSS output. It has
// no SVG or CommonHTML output and no TeX fonts, so the configuration below asks for exactly
// those files: the HTML-CSS output with the STIX-Web web fonts (served locally as well), never a
// font installed on the reader's machine or an image font. docs/_hooks/offline.py fails the
// build if one of them is missing, and docs/_hooks/browser_check.py typesets every page in
// Chromium to check that no formula shows an error.
window.MathJax = {
  config: ["TeX-AMS-MML_HTMLorMML-full.js"],
  jax: ["input/TeX", "output/HTML-CSS"],
  extensions: ["tex2jax.js"],
  // The combined configuration loads noErrors and noUndefined, which would show a bad formula
  // as its TeX source; disabled, MathJax shows its error box (class "merror"), which the browser
  // check counts.
  TeX: {
    extensions: ["AMSmath.js", "AMSsymbols.js"],
    noErrors: {disabled: true},
    noUndefined: {disabled: true},
  },
  tex2jax: {
    inlineMath: [["\\(", "\\)"]],
    displayMath: [["\\[", "\\]"]],
    processEscapes: true,
    processEnvironments: true,
    ignoreClass: ".*",
    processClass: "arithmatex",
  },
  MMLorHTML: {prefer: "HTML"},
  "HTML-CSS": {
    availableFonts: [],
    preferredFont: null,
    webFont: "STIX-Web",
    imageFont: null,
  },
  // The hidden MathML that MathJax adds for screen readers is styled by the NativeMML output's
  // rules, whose fonts (MathJax TeX fonts) the package does not ship: keep the page's font there,
  // so the browser never asks for a missing file.
  styles: {".MJX_Assistive_MathML *": {"font-family": "inherit !important"}},
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
