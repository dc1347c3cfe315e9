package upstream

import (
	"context"
	"net/http"
	"net/http/httptest"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

// TestChecker: an engine whose /health fails twice is taken out, and back
// after one success.
func TestChecker(t *testing.T) {
	var healthy atomic.Bool
	healthy.Store(true)
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path != "/health" {
			w.WriteHeader(http.StatusNotFound)
			return
		}
		if !healthy.Load() {
			w.WriteHeader(http.StatusServiceUnavailable)
		}
	}))
	defer srv.Close()
	var states States
	var changes atomic.Int64
	c := &Checker{Targets: func() []Target { return []Target{{ID: "d", APIBase: srv.URL + "/v1"}} },
		States: &states, Client: srv.Client(), Interval: 20 * time.Millisecond, Timeout: 100 * time.Millisecond,
		OnChange: func(string, bool) { changes.Add(1) }}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error)
	go func() { done <- c.Run(ctx) }()
	h := &states.Get("d").Health
	require.Eventually(t, func() bool { return changes.Load() == 0 && !h.Ejected(time.Now()) }, time.Second, 5*time.Millisecond)
	healthy.Store(false)
	require.Eventually(t, func() bool { return h.ActiveDown() && h.Ejected(time.Now()) }, time.Second, 5*time.Millisecond)
	healthy.Store(true)
	require.Eventually(t, func() bool { return !h.ActiveDown() }, time.Second, 5*time.Millisecond)
	require.Equal(t, int64(2), changes.Load())
	cancel()
	require.NoError(t, <-done)
	require.Equal(t, "http://e:8000/health", HealthURL("http://e:8000/v1/"))
}
