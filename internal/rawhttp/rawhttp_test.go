package rawhttp

import (
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync/atomic"
	"testing"

	"github.com/stretchr/testify/require"
)

func TestDo(t *testing.T) {
	var conns atomic.Int64
	srv := httptest.NewUnstartedServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		b, _ := io.ReadAll(r.Body)
		w.Header().Set("X-Echo-Auth", r.Header.Get("Authorization"))
		switch r.URL.Path {
		case "/length":
			w.Header().Set("Content-Length", "5")
			_, _ = w.Write([]byte("hello"))
		case "/chunked":
			w.WriteHeader(http.StatusTeapot)
			for _, p := range []string{"a", strings.Repeat("b", 5000), "c"} {
				_, _ = w.Write([]byte(p))
				w.(http.Flusher).Flush()
			}
		case "/close":
			w.Header().Set("Connection", "close")
			_, _ = w.Write(b)
		case "/empty":
			w.WriteHeader(http.StatusNoContent)
		}
	}))
	srv.Config.ConnState = func(_ net.Conn, s http.ConnState) {
		if s == http.StateNew {
			conns.Add(1)
		}
	}
	srv.Start()
	defer srv.Close()
	host := strings.TrimPrefix(srv.URL, "http://")
	c, err := Dial(host)
	require.NoError(t, err)
	defer c.Close()
	req := func(path, body string) []byte {
		return Request(http.MethodPost, host, path, [][2]string{{"Authorization", "Bearer k"}, {"Content-Type", "text/plain"}}, []byte(body))
	}

	st, body, err := c.Do(req("/length", ""))
	require.NoError(t, err)
	require.Equal(t, 200, st)
	require.Equal(t, "hello", string(body))
	require.Equal(t, "Bearer k", string(c.Header("x-echo-auth")))
	require.Nil(t, c.Header("X-Absent"))

	st, body, err = c.Do(req("/chunked", ""))
	require.NoError(t, err)
	require.Equal(t, http.StatusTeapot, st)
	require.Equal(t, "a"+strings.Repeat("b", 5000)+"c", string(body))

	st, body, err = c.Do(req("/empty", ""))
	require.NoError(t, err)
	require.Equal(t, http.StatusNoContent, st)
	require.Empty(t, body)
	require.EqualValues(t, 1, conns.Load(), "one keep-alive connection so far")

	st, body, err = c.Do(req("/close", "echo"))
	require.NoError(t, err)
	require.Equal(t, 200, st)
	require.Equal(t, "echo", string(body))
	// The server closed the connection: the next request redials.
	st, body, err = c.Do(req("/length", ""))
	require.NoError(t, err)
	require.Equal(t, 200, st)
	require.Equal(t, "hello", string(body))
	require.EqualValues(t, 2, conns.Load())
}
