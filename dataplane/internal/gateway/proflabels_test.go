package gateway

import (
	"bytes"
	"net/http"
	"runtime/pprof"
	"testing"

	"github.com/stretchr/testify/require"
)

// heldUpstream answers like memUpstream once release is closed, and
// signals each request reaching it on arrived.
type heldUpstream struct {
	arrived chan struct{}
	release chan struct{}
}

func (u heldUpstream) RoundTrip(r *http.Request) (*http.Response, error) {
	u.arrived <- struct{}{}
	<-u.release
	return memUpstream{}.RoundTrip(r)
}

// goroutineLabels returns the goroutine profile with labels (debug=1).
func goroutineLabels(t *testing.T) string {
	t.Helper()
	var b bytes.Buffer
	require.NoError(t, pprof.Lookup("goroutine").WriteTo(&b, 1))
	return b.String()
}

// TestProfileLabels: with Config.ProfileLabels a request's goroutine
// carries its org and key as pprof labels while it runs (a CPU profile
// splits by tenant); without it, none.
func TestProfileLabels(t *testing.T) {
	for _, on := range []bool{true, false} {
		u := heldUpstream{arrived: make(chan struct{}), release: make(chan struct{})}
		e := newEnv(t, func(c *Config) { c.Transport, c.ProfileLabels = u, on })
		e.group("m")
		e.deploy("d1", "m", "http://upstream.invalid/v1", nil)
		// A key of its own per case: the first case's connection
		// goroutine, idle on, keeps its last request's labels.
		id := "key-unlabelled"
		if on {
			id = "key-labelled"
		}
		tok := e.key(id, nil)
		e.apply()
		done := make(chan int)
		go func() {
			resp := e.post(RouteChat, tok, chatBody("m", ""))
			resp.Body.Close()
			done <- resp.StatusCode
		}()
		<-u.arrived
		prof := goroutineLabels(t)
		close(u.release)
		require.Equal(t, http.StatusOK, <-done)
		if on {
			require.Contains(t, prof, `labels: {"key":"key-labelled", "org":"o1"}`)
		} else {
			require.NotContains(t, prof, `"key":"key-unlabelled"`)
		}
	}
}
