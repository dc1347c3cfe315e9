package system

import (
	"context"
	"fmt"
	"net/http"
	"net/http/httptest"
	"sort"
	"sync"
	"testing"
	"time"

	"connectrpc.com/connect"
	"github.com/stretchr/testify/require"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/fieldmaskpb"

	adminv1 "github.com/sluicegw/sluice/proto/gen/sluice/admin/v1"
)

// TestLimitsSlicesLimitLoweredFleetWide is issue 15's limit-change
// must-show: two data planes with quota slices (--limit-slices) admit a
// hot key (rpm 100,000, far from its limit) mostly from slices; its
// rpm_limit is then lowered through the admin API below what the window
// already holds. Within 1 s of the update returning, neither data plane
// admits the key any more: the new limit reaches them with the snapshot,
// the first request that sees it revokes the slices carved under the old
// one, and the window (which counts every slice carved) rejects.
func TestLimitsSlicesLimitLoweredFleetWide(t *testing.T) {
	t.Parallel()
	const lowered = 100
	d := startDist(t)
	srv := httptest.NewServer(benchUpstream(0))
	t.Cleanup(srv.Close)
	lloadDeployment(t, d, "sl", srv.URL, &adminv1.Prices{InputPerToken: 1e-6, OutputPerToken: 2e-6})
	ten := d.NewTenant("slices")
	keyID, tok := lloadKey(t, d, ten, &adminv1.Limits{RpmLimit: proto.Int64(100_000), TpmLimit: proto.Int64(1e9)})
	var ps []*proxy
	for range 2 {
		ps = append(ps, d.StartProxy("default", time.Minute)) // quota slices: the default
	}
	d.waitCaughtUp(t, 15*time.Second, ps...)
	c := lloadClient(t)
	body := `{"model":"sl","max_tokens":16,"messages":[{"role":"user","content":"hi"}]}`

	type answer struct {
		start, done time.Time
		status      int
		code        string
		proxy       int
	}
	var mu sync.Mutex
	var answers []answer
	ctx, stop := context.WithCancel(context.Background())
	var wg sync.WaitGroup
	for w := range 8 {
		wg.Go(func() {
			for ctx.Err() == nil {
				i := w % len(ps)
				t0 := time.Now()
				a := lloadPost(context.Background(), c, ps[i].URL, tok, body)
				mu.Lock()
				answers = append(answers, answer{start: t0, done: time.Now(), status: a.status, code: a.code(), proxy: i})
				mu.Unlock()
				if a.status != http.StatusOK {
					time.Sleep(2 * time.Millisecond)
				}
			}
		})
	}
	// The key is hot and both data planes hold slices.
	require.Eventually(t, func() bool {
		return ps[0].DP.LimitSliceStats().HeldRequests > 0 && ps[1].DP.LimitSliceStats().HeldRequests > 0
	}, 15*time.Second, 10*time.Millisecond, "the data planes never held slices")
	time.Sleep(2 * time.Second)
	_, err := d.Clients().Key.UpdateKey(context.Background(), connect.NewRequest(&adminv1.UpdateKeyRequest{
		Key:        &adminv1.Key{Id: keyID, Limits: &adminv1.Limits{RpmLimit: proto.Int64(lowered), TpmLimit: proto.Int64(1e9)}},
		UpdateMask: &fieldmaskpb.FieldMask{Paths: []string{"limits"}}}))
	require.NoError(t, err)
	changed := time.Now()
	time.Sleep(3 * time.Second)
	stop()
	wg.Wait()

	var before, after int
	var lastOK time.Time
	other := map[string]int{}
	for _, a := range answers {
		switch {
		case a.status == http.StatusOK && a.done.Before(changed):
			before++
		case a.status == http.StatusOK && a.start.After(changed):
			after++
			if a.start.After(lastOK) {
				lastOK = a.start
			}
		case a.status != http.StatusOK && a.status != http.StatusTooManyRequests:
			other[fmt.Sprintf("%d %s", a.status, a.code)]++
		}
	}
	// The window held more than the new limit when it changed.
	require.Greater(t, before, 2*lowered, "admitted before the change")
	var lat time.Duration
	if after > 0 {
		lat = lastOK.Sub(changed)
	}
	okAfter := []time.Duration{}
	for _, a := range answers {
		if a.status == http.StatusOK && a.start.After(changed) {
			okAfter = append(okAfter, a.start.Sub(changed))
		}
	}
	sort.Slice(okAfter, func(i, j int) bool { return okAfter[i] < okAfter[j] })
	t.Logf("admitted before the change %d; admitted after it %d, the last sent %s after the update returned (bound 1 s); other answers %v",
		before, after, lat.Round(time.Millisecond), other)
	require.Less(t, lat, time.Second, "admissions sent after the limit was lowered: %v", okAfter)
	for _, p := range ps {
		st := p.DP.LimitSliceStats()
		require.Zero(t, st.HeldRequests, "slices still held under the lowered limit")
	}
}
