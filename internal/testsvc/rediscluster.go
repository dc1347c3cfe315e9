package testsvc

import (
	"context"
	"fmt"
	"math/rand/v2"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
)

// RedisCluster is a Redis Cluster of three masters (no replicas), each a
// redis-server process on a random loopback port with its files in a test
// temp dir, the 16384 slots split evenly. StartRedisCluster stops it at
// cleanup.
type RedisCluster struct {
	// Addrs are the masters' host:port, in slot order (the first holds
	// slots 0–5460).
	Addrs []string
}

// clusterNodes is the number of masters of a RedisCluster.
const clusterNodes = 3

// StartRedisCluster starts a 3-master Redis Cluster and waits until every
// node reports cluster_state:ok and knows all three masters. A machine
// without redis-server fails the test (it does not skip): the Cluster path
// of the data plane must not go untested silently.
func StartRedisCluster(t testing.TB) *RedisCluster {
	t.Helper()
	bin, err := exec.LookPath("redis-server")
	if err != nil {
		t.Fatalf("the Redis Cluster tests need redis-server on PATH: %v", err)
	}
	dir := t.TempDir()
	rc := &RedisCluster{}
	for i := range clusterNodes {
		rc.Addrs = append(rc.Addrs, startClusterNode(t, bin, filepath.Join(dir, "node-"+strconv.Itoa(i))))
	}
	ctx := context.Background()
	clients := make([]*redis.Client, clusterNodes)
	for i, a := range rc.Addrs {
		clients[i] = redis.NewClient(&redis.Options{Addr: a, MaxRetries: -1})
		defer clients[i].Close()
	}
	per := 16384 / clusterNodes
	for i, c := range clients {
		lo, hi := i*per, (i+1)*per-1
		if i == clusterNodes-1 {
			hi = 16383
		}
		if err := c.ClusterAddSlotsRange(ctx, lo, hi).Err(); err != nil {
			t.Fatalf("redis cluster: ADDSLOTSRANGE %d-%d on %s: %v", lo, hi, rc.Addrs[i], err)
		}
	}
	for _, a := range rc.Addrs[1:] {
		host, port, _ := net.SplitHostPort(a)
		if err := clients[0].ClusterMeet(ctx, host, port).Err(); err != nil {
			t.Fatalf("redis cluster: MEET %s: %v", a, err)
		}
	}
	ok := Until(func() bool {
		for _, c := range clients {
			info, err := c.ClusterInfo(ctx).Result()
			if err != nil || !strings.Contains(info, "cluster_state:ok") || !strings.Contains(info, "cluster_known_nodes:"+strconv.Itoa(clusterNodes)) {
				return false
			}
		}
		return true
	}, 20*time.Second, 20*time.Millisecond)
	if !ok {
		info, _ := clients[0].ClusterInfo(ctx).Result()
		t.Fatalf("redis cluster never became ready:\n%s", info)
	}
	return rc
}

// startClusterNode starts one cluster-enabled redis-server in dir on a
// random port whose cluster bus port (+10000) is free too, retrying on
// another port when the chosen one was taken meanwhile; it stops the
// process at cleanup.
func startClusterNode(t testing.TB, bin, dir string) string {
	t.Helper()
	if err := os.MkdirAll(dir, 0o700); err != nil {
		t.Fatal(err)
	}
	logFile := filepath.Join(dir, "redis.log")
	var lastErr error
	for range 10 {
		port := freePortPair()
		if port == 0 {
			continue
		}
		addr := "127.0.0.1:" + strconv.Itoa(port)
		cmd := exec.Command(bin, "--port", strconv.Itoa(port), "--bind", "127.0.0.1", "--dir", dir,
			"--cluster-enabled", "yes", "--cluster-config-file", filepath.Join(dir, "nodes.conf"),
			"--cluster-node-timeout", "5000", "--save", "", "--appendonly", "no", "--logfile", logFile)
		if err := cmd.Start(); err != nil {
			t.Fatalf("start redis-server: %v", err)
		}
		var exitErr error
		exited := make(chan struct{})
		go func() { exitErr = cmd.Wait(); close(exited) }()
		c := redis.NewClient(&redis.Options{Addr: addr, MaxRetries: -1, DialTimeout: 200 * time.Millisecond})
		up := false
		deadline := time.Now().Add(10 * time.Second)
	wait:
		for time.Now().Before(deadline) {
			select {
			case <-exited:
				lastErr = fmt.Errorf("redis-server on port %d exited: %w", port, exitErr)
				break wait
			default:
			}
			if c.Ping(context.Background()).Err() == nil {
				up = true
				break
			}
			time.Sleep(10 * time.Millisecond)
		}
		_ = c.Close()
		if up {
			t.Cleanup(func() {
				_ = cmd.Process.Kill()
				<-exited
			})
			return addr
		}
		if lastErr == nil {
			_ = cmd.Process.Kill()
			<-exited
			lastErr = fmt.Errorf("redis-server on port %d did not answer", port)
		}
	}
	logTail, _ := os.ReadFile(logFile)
	t.Fatalf("redis cluster node: %v\n%s", lastErr, logTail)
	return ""
}

// freePortPair returns a port p such that p and p+10000 (the cluster bus)
// are both free right now (0: none found).
func freePortPair() int {
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
	return 0
}

// Client returns a go-redis Cluster client of rc with per-call deadlines,
// closed at cleanup.
func (rc *RedisCluster) Client(t testing.TB) *redis.ClusterClient {
	c := redis.NewClusterClient(&redis.ClusterOptions{Addrs: rc.Addrs, ContextTimeoutEnabled: true})
	t.Cleanup(func() { _ = c.Close() })
	return c
}
