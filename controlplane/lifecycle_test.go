package controlplane

import (
	"context"
	"errors"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/sluicegw/sluice/internal/testsvc"
)

// TestComponentErrorStopsPlane: when one component fails (here the admin
// server, its listener closed under it), Run stops every other component
// and returns that error, named after the component; a clean stop (ctx
// done) returns nil.
func TestComponentErrorStopsPlane(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	nats := testsvc.StartNATS(t)
	cfg := Config{DatabaseURL: testsvc.NewDatabase(t), AdminAddr: "127.0.0.1:0", KeyPepper: pepper, KEK: kek, NATSURL: nats.URL,
		BootstrapToken: strings.Repeat("b", 40)}

	cp, err := New(ctx, cfg)
	require.NoError(t, err)
	done := make(chan error, 1)
	go func() { done <- cp.Run(ctx) }()
	require.Eventually(t, func() bool {
		resp, err := http.Get("http://" + cp.Addr() + "/healthz")
		if err != nil {
			return false
		}
		resp.Body.Close()
		return resp.StatusCode == http.StatusOK
	}, 10*time.Second, 10*time.Millisecond)
	require.NoError(t, cp.ln.Close())
	select {
	case err := <-done:
		require.Error(t, err)
		require.True(t, strings.HasPrefix(err.Error(), "admin server: "), err)
		require.False(t, errors.Is(err, context.Canceled), err)
	case <-time.After(30 * time.Second):
		t.Fatal("Run did not stop after its admin server failed")
	}
	require.False(t, cp.pub.IsLeader(), "the publisher stopped with the plane")

	cp2, err := New(ctx, cfg)
	require.NoError(t, err)
	cctx, cancel := context.WithCancel(ctx)
	go func() { done <- cp2.Run(cctx) }()
	cancel()
	select {
	case err := <-done:
		require.NoError(t, err)
	case <-time.After(30 * time.Second):
		t.Fatal("Run did not stop after ctx ended")
	}
}

// TestValidateReportsEverything: one Validate call names every problem.
func TestValidateReportsEverything(t *testing.T) {
	c := Config{AdminAddr: "no-port", BootstrapToken: "short", ShutdownTimeout: -1, AdminMaxRequestBytes: -1,
		AdminReadTimeout: -1, Publish: PublishConfig{Debounce: -1, MaxDelay: -1, TickInterval: -1}}
	err := c.Validate()
	require.Error(t, err)
	for _, want := range []string{"database URL is required", "admin address", "NATS URL is required", "bootstrap admin token",
		"key pepper is required", "key ring is required", "shutdown timeout", "admin max request bytes", "admin read timeout",
		"publish debounce", "publish max delay", "publish tick interval"} {
		require.Contains(t, err.Error(), want)
	}
	require.Len(t, err.(interface{ Unwrap() []error }).Unwrap(), 12)
}
