package console

import (
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"
)

func TestHandler(t *testing.T) {
	mux := http.NewServeMux()
	Mount(mux)
	get := func(method, path string) *httptest.ResponseRecorder {
		rec := httptest.NewRecorder()
		mux.ServeHTTP(rec, httptest.NewRequest(method, path, nil))
		return rec
	}

	r := get(http.MethodGet, "/console")
	require.Equal(t, http.StatusMovedPermanently, r.Code)
	require.Equal(t, "/console/", r.Header().Get("Location"))

	for path, ctype := range map[string]string{"/console/": "text/html", "/console/app.js": "text/javascript", "/console/routing.js": "text/javascript", "/console/style.css": "text/css"} {
		r := get(http.MethodGet, path)
		require.Equal(t, http.StatusOK, r.Code, path)
		require.True(t, strings.HasPrefix(r.Header().Get("Content-Type"), ctype), "%s: %s", path, r.Header().Get("Content-Type"))
		require.Contains(t, r.Header().Get("Content-Security-Policy"), "connect-src 'self'")
		require.Contains(t, r.Header().Get("Content-Security-Policy"), "script-src 'self'")
		require.Equal(t, "nosniff", r.Header().Get("X-Content-Type-Options"))
		require.Equal(t, "no-referrer", r.Header().Get("Referrer-Policy"))
	}
	require.NotContains(t, get(http.MethodGet, "/console/").Body.String(), "<script>", "no inline script (the CSP forbids it)")
	require.Equal(t, http.StatusNotFound, get(http.MethodGet, "/console/missing.js").Code)
	require.Equal(t, http.StatusMethodNotAllowed, get(http.MethodPost, "/console/").Code)
}
