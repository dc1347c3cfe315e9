// Package console serves the web console: static HTML, CSS and JavaScript
// (app.js: the shell and the tenant pages; routing.js: traffic classes,
// health and queues, requests and TTFT, explain)
// embedded in the binary (no build step). The page talks to the admin API
// of the same origin with Connect JSON over fetch, carrying the pasted
// admin token as a bearer token, so every read and change is authorised
// and audited by the API exactly like a sluicectl call; the console has
// no access of its own.
package console

import (
	"embed"
	"io/fs"
	"net/http"
	"strings"
)

//go:embed assets
var assets embed.FS

// Prefix is the path the console is served under.
const Prefix = "/console/"

// contentSecurityPolicy keeps the page to its own files and the API of
// its own origin: no inline script, no third-party origin, no framing.
const contentSecurityPolicy = "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; " +
	"connect-src 'self'; form-action 'none'; base-uri 'none'; frame-ancestors 'none'"

// Mount serves the console on mux at /console and under Prefix.
func Mount(mux *http.ServeMux) {
	h := Handler()
	mux.Handle(Prefix, h)
	mux.Handle(strings.TrimSuffix(Prefix, "/"), h)
}

// Handler serves the console under Prefix; "/console" redirects there.
func Handler() http.Handler {
	sub, err := fs.Sub(assets, "assets")
	if err != nil {
		panic(err) // the embedded tree is fixed at compile time
	}
	files := http.StripPrefix(Prefix, http.FileServerFS(sub))
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.Method != http.MethodGet && r.Method != http.MethodHead {
			w.Header().Set("Allow", "GET, HEAD")
			http.Error(w, "method not allowed", http.StatusMethodNotAllowed)
			return
		}
		if r.URL.Path == strings.TrimSuffix(Prefix, "/") {
			http.Redirect(w, r, Prefix, http.StatusMovedPermanently)
			return
		}
		h := w.Header()
		h.Set("Content-Security-Policy", contentSecurityPolicy)
		h.Set("X-Content-Type-Options", "nosniff")
		h.Set("Referrer-Policy", "no-referrer")
		h.Set("X-Frame-Options", "DENY")
		h.Set("Cache-Control", "no-cache")
		files.ServeHTTP(w, r)
	})
}
