package main

import (
	"context"
	"flag"
	"fmt"
	"strconv"

	"connectrpc.com/connect"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/fieldmaskpb"

	adminv1 "github.com/sluicegw/sluice/proto/gen/sluice/admin/v1"
)

var teamColumns = []column[*adminv1.Team]{
	{"ID", (*adminv1.Team).GetId},
	{"ORG", (*adminv1.Team).GetOrgId},
	{"NAME", (*adminv1.Team).GetName},
	{"BLOCKED", func(t *adminv1.Team) string { return yesNo(t.GetBlocked()) }},
	{"CLASS", func(t *adminv1.Team) string { return trafficClass(t.GetTrafficClass()) }},
	{"LIMITS", func(t *adminv1.Team) string { return limitsSummary(t.GetLimits()) }},
	{"CREATED", func(t *adminv1.Team) string { return formatTime(t.GetCreateTime()) }},
}

// teamFields registers the settable fields of a team.
func teamFields(f *fields, t *adminv1.Team) {
	f.String(&t.Name, "name", "name", "team name, unique in the org (1–100 characters)")
	f.Limits(&t.Limits, limitsPerModel)
	f.Metadata(&t.Metadata)
	f.TrafficClass(&t.TrafficClass, "traffic-class", "traffic_class", "traffic class of the team's keys: interactive, agent or batch")
	f.Map(&t.ModelGroupAliases, "model-group-alias", "model_group_aliases", "requested model → model group, `REQUESTED=GROUP` (repeatable; on update it replaces the map)")
	f.Fallbacks(&t.Fallbacks, "fallbacks", "fallbacks", "fallback model groups of a group for the team's keys, `GROUP=FB1,FB2` (repeatable; GROUP= turns them off; on update it replaces the map)")
}

func teamCommand() *command {
	return group("team", "manage teams (members: 'sluicectl member')", []*command{
		leaf("create", "[NAME]", "create a team", runTeamCreate),
		idCommand("get", "TEAM", "show a team", func(ctx context.Context, c *clients, id string) (proto.Message, error) {
			r, err := call(ctx, c.teams.GetTeam, &adminv1.GetTeamRequest{Id: id})
			return r.GetTeam(), err
		}),
		listCommand("", "list teams", teamColumns, func(fs *flag.FlagSet) fetchPage[*adminv1.Team] {
			req := &adminv1.ListTeamsRequest{}
			fs.StringVar(&req.OrgId, "org", "", "only teams of this org")
			fs.StringVar(&req.NamePrefix, "name-prefix", "", "only teams whose name starts with this")
			fs.Var(&optBool{&req.Blocked}, "blocked", "only blocked (--blocked) or unblocked (--blocked=false) teams")
			return func(ctx context.Context, c *clients, _ []string, size int32, tok string) ([]*adminv1.Team, string, error) {
				req.PageSize, req.PageToken = size, tok
				r, err := call(ctx, c.teams.ListTeams, req)
				return r.GetTeams(), r.GetNextPageToken(), err
			}
		}),
		updateCommand("team", func() *adminv1.Team { return &adminv1.Team{} }, teamFields,
			func(ctx context.Context, c *clients, id string, o *adminv1.Team, mask *fieldmaskpb.FieldMask) (*adminv1.Team, error) {
				o.Id = id
				r, err := call(ctx, c.teams.UpdateTeam, &adminv1.UpdateTeamRequest{Team: o, UpdateMask: mask})
				return r.GetTeam(), err
			}),
		deleteCommand("team", func(ctx context.Context, c *clients, id string) (proto.Message, error) {
			return call(ctx, c.teams.DeleteTeam, &adminv1.DeleteTeamRequest{Id: id})
		}),
		idCommand("block", "TEAM", "block a team: its keys are rejected (403)", func(ctx context.Context, c *clients, id string) (proto.Message, error) {
			r, err := call(ctx, c.teams.BlockTeam, &adminv1.BlockTeamRequest{Id: id})
			return r.GetTeam(), err
		}),
		idCommand("unblock", "TEAM", "unblock a team", func(ctx context.Context, c *clients, id string) (proto.Message, error) {
			r, err := call(ctx, c.teams.UnblockTeam, &adminv1.UnblockTeamRequest{Id: id})
			return r.GetTeam(), err
		}),
		memberCommand(),
	}, "teams")
}

func runTeamCreate(ctx context.Context, a *app, c *cmdArgs) error {
	fs := a.flags(c)
	t := &adminv1.Team{}
	fs.StringVar(&t.OrgId, "org", "", "org of the team (default: the token's org; required with a platform token)")
	teamFields(newFields(fs), t)
	if err := a.parseNamed(fs, c, &t.Name, "name"); err != nil {
		return err
	}
	cl, p, err := a.connect()
	if err != nil {
		return err
	}
	r, err := call(ctx, cl.teams.CreateTeam, &adminv1.CreateTeamRequest{
		OrgId: t.OrgId, Name: t.Name, Limits: t.Limits, Metadata: t.Metadata,
		TrafficClass: t.TrafficClass, ModelGroupAliases: t.ModelGroupAliases, Fallbacks: t.Fallbacks,
	})
	return p.result(r.GetTeam(), err)
}

var memberColumns = []column[*adminv1.TeamMember]{
	{"TEAM", (*adminv1.TeamMember).GetTeamId},
	{"USER", (*adminv1.TeamMember).GetUserId},
	{"MAX BUDGET IN TEAM", func(m *adminv1.TeamMember) string {
		if m.MaxBudgetInTeam == nil {
			return ""
		}
		return "$" + strconv.FormatFloat(m.GetMaxBudgetInTeam(), 'f', -1, 64) + "/" + m.GetLimits().GetBudgetDuration()
	}},
	{"LIMITS", func(m *adminv1.TeamMember) string { return limitsSummary(m.GetLimits()) }},
	{"ADDED", func(m *adminv1.TeamMember) string { return formatTime(m.GetCreateTime()) }},
}

// memberFields registers the settable fields of a team membership.
func memberFields(f *fields, m *adminv1.TeamMember) {
	f.Float(&m.MaxBudgetInTeam, "max-budget-in-team", "max_budget_in_team", "budget in USD the user may spend through this team per --budget-duration")
	f.Limits(&m.Limits, limitsMember)
}

func memberCommand() *command {
	return group("member", "manage team members (a user's membership of a team and its limits)", []*command{
		leaf("add", "TEAM_ID USER_ID", "add a user of the team's org to the team", runMemberAdd, "create"),
		leaf("get", "TEAM_ID USER_ID", "show one membership", runMemberGet),
		listCommand("TEAM_ID", "list the members of a team", memberColumns, func(fs *flag.FlagSet) fetchPage[*adminv1.TeamMember] {
			return func(ctx context.Context, c *clients, pos []string, size int32, tok string) ([]*adminv1.TeamMember, string, error) {
				r, err := call(ctx, c.teams.ListTeamMembers, &adminv1.ListTeamMembersRequest{TeamId: pos[0], PageSize: size, PageToken: tok})
				return r.GetMembers(), r.GetNextPageToken(), err
			}
		}),
		leaf("update", "TEAM_ID USER_ID", "change the member fields given as flags (--clear FLAG unsets one)", runMemberUpdate),
		leaf("remove", "TEAM_ID USER_ID", "remove a user from a team", runMemberRemove, "delete", "rm"),
	}, "members")
}

func runMemberAdd(ctx context.Context, a *app, c *cmdArgs) error {
	fs := a.flags(c)
	m := &adminv1.TeamMember{}
	memberFields(newFields(fs), m)
	pos, cl, p, err := a.parseConnect(fs, c, 2, 2)
	if err != nil {
		return err
	}
	r, err := call(ctx, cl.teams.AddTeamMember, &adminv1.AddTeamMemberRequest{
		TeamId: pos[0], UserId: pos[1], MaxBudgetInTeam: m.MaxBudgetInTeam, Limits: m.Limits,
	})
	return p.result(r.GetMember(), err)
}

// runMemberGet finds one membership by listing the team's members (the
// API has no single-member read).
func runMemberGet(ctx context.Context, a *app, c *cmdArgs) error {
	pos, cl, p, err := a.parseConnect(a.flags(c), c, 2, 2)
	if err != nil {
		return err
	}
	members, err := collect(ctx, 0, func(ctx context.Context, size int32, tok string) ([]*adminv1.TeamMember, string, error) {
		r, err := call(ctx, cl.teams.ListTeamMembers, &adminv1.ListTeamMembersRequest{TeamId: pos[0], PageSize: size, PageToken: tok})
		return r.GetMembers(), r.GetNextPageToken(), err
	})
	if err != nil {
		return err
	}
	for _, m := range members {
		if m.GetUserId() == pos[1] {
			return p.one(m, m)
		}
	}
	return &apiError{connect.NewError(connect.CodeNotFound, fmt.Errorf("user %s is not a member of team %s", pos[1], pos[0]))}
}

func runMemberUpdate(ctx context.Context, a *app, c *cmdArgs) error {
	fs := a.flags(c)
	m := &adminv1.TeamMember{}
	f := newFields(fs)
	memberFields(f, m)
	f.Clearable()
	pos, err := a.parse(fs, c, 2, 2)
	if err != nil {
		return err
	}
	mask, err := f.updateMask()
	if err != nil {
		return err
	}
	m.TeamId, m.UserId = pos[0], pos[1]
	cl, p, err := a.connect()
	if err != nil {
		return err
	}
	r, err := call(ctx, cl.teams.UpdateTeamMember, &adminv1.UpdateTeamMemberRequest{Member: m, UpdateMask: mask})
	return p.result(r.GetMember(), err)
}

func runMemberRemove(ctx context.Context, a *app, c *cmdArgs) error {
	pos, cl, p, err := a.parseConnect(a.flags(c), c, 2, 2)
	if err != nil {
		return err
	}
	r, err := call(ctx, cl.teams.RemoveTeamMember, &adminv1.RemoveTeamMemberRequest{TeamId: pos[0], UserId: pos[1]})
	if err != nil {
		return err
	}
	if p.format != outTable {
		return p.message(r)
	}
	_, err = fmt.Fprintf(a.stdout, "Removed user %s from team %s.\n", pos[1], pos[0])
	return err
}
