package main

import (
	"context"
	"fmt"
	"slices"
	"strconv"
	"strings"

	adminv1 "github.com/sluicegw/sluice/proto/gen/sluice/admin/v1"
)

// Fleet, rollout and region commands (SPEC §6): which data planes run
// which config version, and how versions reach each region. The server
// takes platform-scoped tokens only.

var dataPlaneColumns = []column[*adminv1.DataPlane]{
	{"INSTANCE", (*adminv1.DataPlane).GetInstanceId},
	{"REGION", (*adminv1.DataPlane).GetRegion},
	{"VERSION", func(d *adminv1.DataPlane) string { return strconv.FormatUint(d.GetAppliedVersion(), 10) }},
	{"EVENTS SEQ", func(d *adminv1.DataPlane) string { return strconv.FormatUint(d.GetEventsSeq(), 10) }},
	{"HEALTH", dataPlaneHealth},
	{"STALENESS", func(d *adminv1.DataPlane) string {
		return strconv.FormatFloat(d.GetStalenessSeconds(), 'f', 1, 64) + "s"
	}},
	{"IN FLIGHT", func(d *adminv1.DataPlane) string { return strconv.FormatInt(d.GetInFlight(), 10) }},
	{"REJECTED", func(d *adminv1.DataPlane) string { return rejectedSummary(d.GetRejectedSnapshots()) }},
	{"OUT OF ROTATION", func(d *adminv1.DataPlane) string { return ejectedSummary(d.GetEjectedDeployments()) }},
	{"LAST SEEN", func(d *adminv1.DataPlane) string { return formatTime(d.GetLastSeen()) }},
}

// dataPlaneHealth is the instance's health; an instance that has refused
// its region's current snapshot for longer than its bound says which
// ("rejecting control plane: version 1 < running 2").
func dataPlaneHealth(d *adminv1.DataPlane) string {
	r := d.GetRejecting()
	if r == nil || !r.GetPastBound() || d.GetHealth() == "lost" {
		return d.GetHealth()
	}
	if r.GetVersion() != 0 && r.GetVersion() < r.GetRunningVersion() {
		return fmt.Sprintf("rejecting control plane: version %d < running %d", r.GetVersion(), r.GetRunningVersion())
	}
	return fmt.Sprintf("rejecting control plane: version %d: %s", r.GetVersion(), r.GetReason())
}

// rejectedSummary is a one-cell view of rejected snapshots: their count
// and the latest one's version ("2 (last v7)").
func rejectedSummary(rs []*adminv1.RejectedSnapshot) string {
	if len(rs) == 0 {
		return "0"
	}
	last := rs[0]
	for _, r := range rs[1:] {
		if r.GetTime().AsTime().After(last.GetTime().AsTime()) {
			last = r
		}
	}
	return fmt.Sprintf("%d (last v%d)", len(rs), last.GetVersion())
}

var regionColumns = []column[*adminv1.RegionStatus]{
	{"REGION", func(s *adminv1.RegionStatus) string { return s.GetRegion().GetName() }},
	{"POLICY", func(s *adminv1.RegionStatus) string { return rolloutPolicy(s.GetRegion().GetPolicy()) }},
	{"VERSION", func(s *adminv1.RegionStatus) string { return strconv.FormatUint(s.GetRegion().GetCurrentVersion(), 10) }},
	{"INSTANCES", func(s *adminv1.RegionStatus) string { return strconv.Itoa(len(s.GetDataPlanes())) }},
	{"RUNNING", func(s *adminv1.RegionStatus) string { return runningSummary(s.GetDataPlanes()) }},
	{"UPDATED", func(s *adminv1.RegionStatus) string { return formatTime(s.GetRegion().GetUpdateTime()) }},
}

// runningSummary counts a region's instances per applied version, newest
// first ("v8: 2, v7: 1"); lost instances are counted apart.
func runningSummary(ds []*adminv1.DataPlane) string {
	counts := map[uint64]int{}
	lost := 0
	for _, d := range ds {
		if d.GetHealth() == "lost" {
			lost++
			continue
		}
		counts[d.GetAppliedVersion()]++
	}
	versions := make([]uint64, 0, len(counts))
	for v := range counts {
		versions = append(versions, v)
	}
	slices.Sort(versions)
	slices.Reverse(versions)
	parts := make([]string, 0, len(versions)+1)
	for _, v := range versions {
		parts = append(parts, fmt.Sprintf("v%d: %d", v, counts[v]))
	}
	if lost > 0 {
		parts = append(parts, fmt.Sprintf("lost: %d", lost))
	}
	return strings.Join(parts, ", ")
}

func rolloutPolicy(p adminv1.RolloutPolicy) string {
	if p == adminv1.RolloutPolicy_ROLLOUT_POLICY_UNSPECIFIED {
		return ""
	}
	return enumName(p.Descriptor(), p.Number())
}

func fleetCommand() *command {
	return group("fleet", "show the data planes and the config version each runs", []*command{
		leaf("list", "", "list data-plane instances from their heartbeats", runFleetList, "ls"),
	})
}

func rolloutCommand() *command {
	return group("rollout", "move regions between config versions (canary first)", []*command{
		leaf("status", "", "show the latest config version and, per region, the version it runs and its instances", runRolloutStatus),
		leaf("promote", "REGION VERSION", "make a region run a config version (not older than its current one)", func(ctx context.Context, a *app, c *cmdArgs) error {
			return runSetVersion(ctx, a, c, false)
		}),
		leaf("rollback", "REGION VERSION", "make a region run an older config version", func(ctx context.Context, a *app, c *cmdArgs) error {
			return runSetVersion(ctx, a, c, true)
		}),
	})
}

func regionCommand() *command {
	return group("region", "manage regions and their rollout policy ('sluicectl rollout status' lists them)", []*command{
		leaf("upsert", "NAME", "create a region or change its rollout policy", runRegionUpsert, "create", "update"),
	}, "regions")
}

func runFleetList(ctx context.Context, a *app, c *cmdArgs) error {
	fs := a.flags(c)
	region := fs.String("region", "", "only instances of this `REGION`")
	_, cl, p, err := a.parseConnect(fs, c, 0, 0)
	if err != nil {
		return err
	}
	r, err := call(ctx, cl.fleet.ListDataPlanes, &adminv1.ListDataPlanesRequest{Region: *region})
	if err != nil {
		return err
	}
	return list(p, r.GetDataPlanes(), dataPlaneColumns)
}

func runRolloutStatus(ctx context.Context, a *app, c *cmdArgs) error {
	_, cl, p, err := a.parseConnect(a.flags(c), c, 0, 0)
	if err != nil {
		return err
	}
	r, err := call(ctx, cl.rollout.GetRolloutStatus, &adminv1.GetRolloutStatusRequest{})
	if err != nil {
		return err
	}
	if p.format != outTable {
		return p.message(r)
	}
	if l := r.GetLatest(); l != nil {
		fmt.Fprintf(a.stdout, "Latest config version: %d (events_seq %d, %d bytes, compiled %s)\n\n",
			l.GetVersion(), l.GetEventsSeq(), l.GetSizeBytes(), formatTime(l.GetCreateTime()))
	} else {
		fmt.Fprint(a.stdout, "No config version compiled yet.\n\n")
	}
	if e := r.GetEpoch(); e != nil {
		fmt.Fprintf(a.stdout, "Distribution epoch %d since %s: versions above %d (first %d), events above %d.\n  Why: %s\n",
			e.GetEpoch(), formatTime(e.GetStartTime()), e.GetVersionFloor(), e.GetFirstVersion(), e.GetEventsFloor(), e.GetReason())
		for _, x := range e.GetReapplied() {
			fmt.Fprintf(a.stdout, "  Re-applied: %s\n", x)
		}
		fmt.Fprintln(a.stdout)
	}
	return list(p, r.GetRegions(), regionColumns)
}

// runSetVersion promotes region (rollback false) or rolls it back.
func runSetVersion(ctx context.Context, a *app, c *cmdArgs, rollback bool) error {
	pos, err := a.parse(a.flags(c), c, 2, 2)
	if err != nil {
		return err
	}
	version, err := strconv.ParseUint(strings.TrimPrefix(pos[1], "v"), 10, 64)
	if err != nil || version == 0 {
		return fmt.Errorf("%s: version %q: want a config version number (see 'sluicectl rollout status')", c.path, pos[1])
	}
	cl, p, err := a.connect()
	if err != nil {
		return err
	}
	var region *adminv1.Region
	if rollback {
		r, err := call(ctx, cl.rollout.RollbackRegion, &adminv1.RollbackRegionRequest{Region: pos[0], Version: version})
		if err != nil {
			return err
		}
		region = r.GetRegion()
	} else {
		r, err := call(ctx, cl.rollout.PromoteVersion, &adminv1.PromoteVersionRequest{Region: pos[0], Version: version})
		if err != nil {
			return err
		}
		region = r.GetRegion()
	}
	return p.one(region, region)
}

func runRegionUpsert(ctx context.Context, a *app, c *cmdArgs) error {
	fs := a.flags(c)
	var policy adminv1.RolloutPolicy
	fs.Var(newEnum(&policy, adminv1.RolloutPolicy_value, "ROLLOUT_POLICY_"), "policy",
		"rollout policy: auto (new versions go live at once) or staged (they wait for 'rollout promote'; security events still arrive at once)")
	pos, err := a.parse(fs, c, 1, 1)
	if err != nil {
		return err
	}
	if policy == adminv1.RolloutPolicy_ROLLOUT_POLICY_UNSPECIFIED {
		return fmt.Errorf("%s: --policy is required: auto or staged", c.path)
	}
	cl, p, err := a.connect()
	if err != nil {
		return err
	}
	r, err := call(ctx, cl.rollout.UpsertRegion, &adminv1.UpsertRegionRequest{Name: pos[0], Policy: policy})
	return p.result(r.GetRegion(), err)
}

// ejectedSummary lists the deployments an instance keeps out of rotation:
// "dep_a (ejected), dep_b (parked)"; "-" for none.
func ejectedSummary(ej []*adminv1.EjectedDeployment) string {
	if len(ej) == 0 {
		return "-"
	}
	parts := make([]string, 0, len(ej))
	for _, e := range ej {
		parts = append(parts, e.GetDeploymentId()+" ("+e.GetReason()+")")
	}
	return strings.Join(parts, ", ")
}
