package limits

import (
	"context"
	"fmt"
	"strings"
	"testing"
	"time"
)

func TestZZProf(t *testing.T) {
	bd := setup(t, func(c *Config) { c.rateWindow, c.rateBucket = 600*time.Millisecond, 10*time.Millisecond })
	ctx := context.Background()
	bud := func() *Budget { return &Budget{CapMicros: 1e12, Window: "30d"} }
	scopes := []Scope{
		{Kind: KindKey, ID: "k", RPM: 1e9, TPM: 1e12, MaxParallel: 1e6, Budget: bud()},
		{Kind: KindTeam, ID: "t", RPM: 1e9, TPM: 1e12, MaxParallel: 1e6, Budget: bud()},
		{Kind: KindOrg, ID: bd.org, RPM: 1e9, TPM: 1e12, MaxParallel: 1e6, Budget: bud()},
	}
	mk := func(src string, marks []string) *script {
		mark := "__T[#__T+1] = tonumber(redis.call('TIME')[2])\n"
		src = strings.Replace(src, "local now = now_ms()", "local __T = {}\n"+mark+"local now = now_ms()", 1)
		for _, m := range marks {
			src = strings.Replace(src, m, mark+m, 1)
		}
		return newScript(commonLua + "\n" + src)
	}
	adm := mk(admitLua, []string{"-- Phase 1: check", "-- Phase 2: consume", "-- Headers: the tightest", "\nif rej then\n  return"})
	adm.src = strings.Replace(adm.src, "\nif rej then\n  return", "\ndo return __T end\nif rej then\n  return", 1)
	adm = newScript(adm.src)
	mins := []int64{1 << 40, 1 << 40, 1 << 40, 1 << 40}
	start := time.Now()
	for i := 0; time.Since(start) < 4*time.Second; i++ {
		d := bd.admit(t, bd.req(fmt.Sprint("w", i), 100, 1000, scopes...))
		_, _ = bd.lim.Settle(ctx, d.Lease, 90, 900)
		if time.Since(start) > time.Second && i%5 == 0 {
			req := bd.req(fmt.Sprint("p", i), 100, 1000, scopes...)
			units, _ := validate(&req)
			kb := newKeyBuilder(bd.lim.cfg.KeyPrefix, req.OrgID)
			keys := kb.callKeys(req.RequestID, req.Scopes)
			args := []any{req.RequestID, req.EstTokens, req.MaxCostMicros, 30000, 2000, 21600000, 1000, 600, 10, 1, len(req.Scopes)}
			for i, s := range req.Scopes {
				args = append(args, s.RPM, s.TPM, s.MaxParallel, s.Budget.CapMicros, units[i].Unit, units[i].N, 0, 0)
			}
			v, err := bd.lim.run(ctx, adm, "x", keys, args)
			if err != nil {
				t.Fatal(err)
			}
			for j := 1; j < len(v); j++ {
				x := v[j] - v[j-1]
				if x < 0 {
					x += 1e6
				}
				mins[j-1] = min(mins[j-1], x)
			}
		}
	}
	t.Logf("min µs: start→phase1 %d, phase1 %d, phase2 %d, headers %d", mins[0], mins[1], mins[2], mins[3])
}
