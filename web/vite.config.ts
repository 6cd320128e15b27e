// The panel is built to web/dist and served by the REST proxy (CAIRN_PANEL_DIR).
// No inline script or style ends up in index.html, so the proxy's
// Content-Security-Policy can stay at script-src 'self' / style-src 'self'.
import { defineConfig } from "vite";

export default defineConfig({
  oxc: { jsx: { runtime: "automatic", importSource: "preact" } },
  build: {
    outDir: "dist",
    emptyOutDir: true,
    target: "es2022",
    modulePreload: { polyfill: false },
    assetsInlineLimit: 0,
    sourcemap: false,
    reportCompressedSize: true,
  },
  server: {
    // `npm run dev` in web/ against a proxy started by `make run`
    proxy: { "/v1": "http://127.0.0.1:8080", "/panel": "http://127.0.0.1:8080" },
  },
});
