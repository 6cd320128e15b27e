# The web panel (web/): npm ci from the lockfile, types generated from the proxy's
# OpenAPI, tsc, and a Vite build into web/dist, which the REST proxy serves
# (CAIRN_PANEL_DIR). `make test` also needs Debian's chromium for the panel's
# end-to-end tests; Playwright's own browser download is never run.
WEB := web
WEB_STAMP := $(WEB)/node_modules/.installed
export PLAYWRIGHT_SKIP_BROWSER_DOWNLOAD := 1

.PHONY: web web-install web-gen web-check chromium

$(WEB_STAMP): $(WEB)/package.json $(WEB)/package-lock.json
	cd $(WEB) && npm ci --no-audit --no-fund --silent
	touch $(WEB_STAMP)

web-install: $(WEB_STAMP) ## install the panel's pinned npm packages (npm ci)

web-gen: $(WEB_STAMP) ## regenerate web/src/api/schema.d.ts from the proxy's OpenAPI
	cd $(WEB) && node scripts/gen-api.mjs

web: $(WEB_STAMP) ## build the web panel into web/dist (served by the REST proxy)
	cd $(WEB) && node scripts/gen-api.mjs --check && npx tsc --noEmit && npx vite build --logLevel warn
	rm -rf build/web-unit && cd $(WEB) && npx tsc -p tsconfig.unit.json && node --test ../build/web-unit/tests/

web-check: web ## fail when the panel's types are stale or it no longer type-checks against the protos

# fonts-wqy-microhei: so the 简体中文 screenshots show characters, not boxes
chromium: ## Debian's chromium (and a CJK font) for the panel's end-to-end tests (as root)
	@test -x /usr/bin/chromium && test -d /usr/share/fonts/truetype/wqy || \
	  { apt-get update -q && DEBIAN_FRONTEND=noninteractive \
	    apt-get install -y -q --no-install-recommends chromium fonts-wqy-microhei; }
