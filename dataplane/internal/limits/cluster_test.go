package limits

import (
	"context"
	"fmt"
	"math/rand/v2"
	"net"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/require"
)

// freePort returns a port p such that p and its cluster bus port p+10000
// are both free right now.
func freePort(t *testing.T) int {
	for range 100 {
		p := 20000 + rand.IntN(20000)
		ok := true
		for _, q := range []int{p, p + 10000} {
			ln, err := net.Listen("tcp", "127.0.0.1:"+strconv.Itoa(q))
			if err != nil {
				ok = false
				break
			}
			_ = ln.Close()
		}
		if ok {
			return p
		}
	}
	t.Fatal("no free port pair")
	return 0
}

// startCluster starts three redis-server processes in cluster mode in
// t.TempDir() and joins them into a cluster with no replicas.
func startCluster(t *testing.T) []string {
	dir := t.TempDir()
	var addrs []string
	for i := range 3 {
		port := freePort(t)
		cmd := exec.Command("redis-server", "--port", strconv.Itoa(port), "--bind", "127.0.0.1",
			"--cluster-enabled", "yes", "--cluster-config-file", filepath.Join(dir, fmt.Sprintf("nodes-%d.conf", i)),
			"--dir", dir, "--save", "", "--appendonly", "no")
		require.NoError(t, cmd.Start(), "the cluster test needs redis-server")
		t.Cleanup(func() { _ = cmd.Process.Kill(); _ = cmd.Wait() })
		addr := "127.0.0.1:" + strconv.Itoa(port)
		addrs = append(addrs, addr)
		c := redis.NewClient(&redis.Options{Addr: addr})
		require.Eventually(t, func() bool { return c.Ping(context.Background()).Err() == nil }, 5*time.Second, 20*time.Millisecond)
		_ = c.Close()
	}
	args := append([]string{"--cluster", "create"}, addrs...)
	out, err := exec.Command("redis-cli", append(args, "--cluster-replicas", "0", "--cluster-yes")...).CombinedOutput()
	require.NoError(t, err, "%s", out)
	for _, addr := range addrs {
		c := redis.NewClient(&redis.Options{Addr: addr})
		require.Eventually(t, func() bool {
			info, err := c.ClusterInfo(context.Background()).Result()
			return err == nil && strings.Contains(info, "cluster_state:ok")
		}, 10*time.Second, 50*time.Millisecond)
		_ = c.Close()
	}
	return addrs
}

// TestCluster runs admission, renewal and settlement with every scope kind
// on a 3-node Redis Cluster: a script touching keys of two slots would fail
// with CROSSSLOT, so passing proves every key of a call shares the org's slot.
func TestCluster(t *testing.T) {
	t.Parallel()
	addrs := startCluster(t)
	rdb := redis.NewClusterClient(&redis.ClusterOptions{Addrs: addrs, ContextTimeoutEnabled: true})
	t.Cleanup(func() { _ = rdb.Close() })
	// Budget windows are seeded (seed.lua) on the cluster too.
	led := &fakeLedger{}
	lim, err := New(Config{Client: rdb, KeyPrefix: "sluice:", CallTimeout: time.Second, Quarantine: time.Millisecond, Seeds: led.seeds})
	require.NoError(t, err)
	ctx := context.Background()

	budget := func(w string) *Budget { return &Budget{CapMicros: 1e9, Window: w} }
	slots := map[int64]bool{}
	for o := range 12 {
		org := fmt.Sprintf("org-%d", o)
		slot, err := rdb.ClusterKeySlot(ctx, newKeyBuilder("sluice:", org).epoch()).Result()
		require.NoError(t, err)
		slots[slot] = true
		scopes := []Scope{
			{Kind: KindKey, ID: "k", RPM: 100, TPM: 1e6, MaxParallel: 10, Budget: budget("30d")},
			{Kind: KindUser, ID: "u", MaxParallel: 10, Budget: budget("1mo")},
			{Kind: KindMember, ID: "t/u", Budget: budget("7d")},
			{Kind: KindTeam, ID: "t", RPM: 100, MaxParallel: 10, Budget: budget("1d")},
			{Kind: KindOrg, ID: org, TPM: 1e6, Budget: budget("12mo")},
			{Kind: KindCustomer, ID: "c", RPM: 100, Budget: budget("24h")},
			{Kind: KindKeyModel, ID: "k/qwen-30b", RPM: 100, TPM: 1e6, Budget: budget("1d")},
			{Kind: KindTeamModel, ID: "t/qwen-30b", TPM: 1e6, Budget: budget("1d")},
			{Kind: KindDeployment, ID: "vllm-a", MaxParallel: 10},
		}
		time.Sleep(2 * time.Millisecond) // past the first-use quarantine
		for r := range 3 {
			req := Request{OrgID: org, RequestID: fmt.Sprint("r", r), Scopes: scopes, EstTokens: 100, MaxCostMicros: 1000}
			d, err := lim.Admit(ctx, req)
			require.NoError(t, err)
			if !d.Allowed {
				// The very first call of an org starts its epoch.
				require.True(t, d.Rejection.Quarantined, "%+v", d.Rejection)
				time.Sleep(5 * time.Millisecond)
				d, err = lim.Admit(ctx, req)
				require.NoError(t, err)
			}
			require.True(t, d.Allowed, "%+v", d.Rejection)
			st, err := lim.Renew(ctx, d.Lease)
			require.NoError(t, err)
			require.Equal(t, RenewExtended, st)
			res, err := lim.Settle(ctx, d.Lease, 90, 800)
			require.NoError(t, err)
			require.True(t, res.Applied)
		}
		n, err := rdb.ZCard(ctx, newKeyBuilder("sluice:", org).scope(&scopes[8])[1]).Result()
		require.NoError(t, err)
		require.Zero(t, n)
	}
	require.Greater(t, len(slots), 1, "orgs spread over several slots")
}
