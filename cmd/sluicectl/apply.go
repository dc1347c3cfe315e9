package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"sort"

	"connectrpc.com/connect"
	"google.golang.org/protobuf/encoding/protojson"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/reflect/protoreflect"
	"google.golang.org/protobuf/types/known/fieldmaskpb"

	adminv1 "github.com/sluicegw/sluice/proto/gen/sluice/admin/v1"
)

func applyCommand() *command {
	return leaf("apply", "", "create or change the objects a YAML file declares (-f FILE or -f -); --dry-run prints the diff", runApply)
}

// change is one planned mutation: what it is, the field differences it
// makes, and the call that makes it.
type change struct {
	op    string // "create", "update", "delete"
	what  string // "Team acme/agents"
	lines []string
	do    func(ctx context.Context, st *liveState) error
}

// liveState is what the control plane holds for the kinds a file covers,
// by the names documents use. Creating an org records its id here, so
// the teams and users of a new org are created in the same run.
type liveState struct {
	cl      *clients
	getenv  func(string) string
	orgs    map[string]*adminv1.Org // by name
	orgName map[string]string       // id → name
	teams   map[string]*adminv1.Team
	users   map[string]*adminv1.User
	groups  map[string]*adminv1.ModelGroup
	deps    map[string][]*adminv1.Deployment // by model group
	// depTraffic are the traffic settings of the live deployments a
	// document sets traffic for, by deployment id.
	depTraffic map[string]*adminv1.DeploymentTraffic
	// groupTraffic are the traffic settings of the live model groups a
	// document sets traffic for, by name.
	groupTraffic map[string]*adminv1.ModelGroupTraffic
	// members, customers, keys and org traffic (apply_tenants.go)
	tenantState
	// out is where a created key's token is printed (once).
	out io.Writer
}

func runApply(ctx context.Context, a *app, c *cmdArgs) error {
	fs := a.flags(c)
	file := fs.String("f", "", "the YAML file to apply (\"-\": standard input)")
	fs.StringVar(file, "filename", "", "same as -f")
	dry := fs.Bool("dry-run", false, "print what would change and change nothing")
	prune := fs.Bool("prune", false, "also delete objects of the kinds and orgs the file covers that it does not name (needs --yes)")
	yes := fs.Bool("yes", false, "confirm --prune")
	if _, err := a.parse(fs, c, 0, 0); err != nil {
		return err
	}
	if *file == "" {
		return errors.New("apply: -f FILE is required (\"-f -\" reads standard input)")
	}
	if *prune && !*yes && !*dry {
		return errors.New("apply: --prune deletes objects the file does not name: confirm with --yes (or look first with --dry-run)")
	}
	set, err := readDocuments(*file)
	if err != nil {
		return err
	}
	cl, _, err := a.connect()
	if err != nil {
		return err
	}
	st, err := loadState(ctx, cl, set)
	if err != nil {
		return err
	}
	st.getenv, st.out = a.getenv, a.stdout
	changes, err := plan(st, set, *prune)
	if err != nil {
		return err
	}
	printPlan(a.stdout, changes, *dry)
	if *dry {
		return nil
	}
	for _, ch := range changes {
		if err := ch.do(ctx, st); err != nil {
			return fmt.Errorf("%s %s: %w", ch.op, ch.what, err)
		}
	}
	return nil
}

// readDocuments reads and decodes path ("-": standard input).
func readDocuments(path string) (*docSet, error) {
	var r io.Reader
	if path == "-" {
		r = os.Stdin
	} else {
		f, err := os.Open(path)
		if err != nil {
			return nil, err
		}
		defer f.Close()
		r = f
	}
	set, err := decodeDocuments(r)
	if err != nil {
		return nil, fmt.Errorf("%s: %w", path, err)
	}
	return set, nil
}

func printPlan(w io.Writer, changes []change, dry bool) {
	n := map[string]int{}
	for _, ch := range changes {
		n[ch.op]++
		sign := map[string]string{"create": "+", "update": "~", "delete": "-"}[ch.op]
		fmt.Fprintf(w, "%s %s\n", sign, ch.what)
		for _, l := range ch.lines {
			fmt.Fprintf(w, "    %s\n", l)
		}
	}
	verb := "Applied"
	if dry {
		verb = "Dry run"
	}
	if len(changes) == 0 {
		fmt.Fprintf(w, "%s: no changes.\n", verb)
		return
	}
	fmt.Fprintf(w, "%s: %d to create, %d to change, %d to delete.\n", verb, n["create"], n["update"], n["delete"])
}

// loadState reads the objects of the kinds set covers: every org (names
// are platform-wide), the teams and users of the orgs the file names, and
// every model group with its deployments.
func loadState(ctx context.Context, cl *clients, set *docSet) (*liveState, error) {
	st := &liveState{cl: cl, orgs: map[string]*adminv1.Org{}, orgName: map[string]string{},
		teams: map[string]*adminv1.Team{}, users: map[string]*adminv1.User{},
		groups: map[string]*adminv1.ModelGroup{}, deps: map[string][]*adminv1.Deployment{}}
	// Model groups name the orgs they are granted to: a token that may
	// not list orgs (an org token reading model groups) sees grants by id.
	orgsNeeded := set.covered[kindOrg] || set.covered[kindTeam] || set.covered[kindUser]
	if orgsNeeded || set.covered[kindModelGroup] {
		orgs, err := collect(ctx, 0, func(ctx context.Context, size int32, tok string) ([]*adminv1.Org, string, error) {
			r, err := call(ctx, cl.orgs.ListOrgs, &adminv1.ListOrgsRequest{PageSize: size, PageToken: tok})
			return r.GetOrgs(), r.GetNextPageToken(), err
		})
		if err != nil && (orgsNeeded || !permissionDenied(err)) {
			return nil, fmt.Errorf("list orgs: %w", err)
		}
		for _, o := range orgs {
			st.orgs[o.GetName()] = o
			st.orgName[o.GetId()] = o.GetName()
		}
	}
	for _, org := range set.orgNames() {
		o := st.orgs[org]
		if o == nil {
			continue
		}
		if set.covered[kindTeam] {
			teams, err := collect(ctx, 0, func(ctx context.Context, size int32, tok string) ([]*adminv1.Team, string, error) {
				r, err := call(ctx, cl.teams.ListTeams, &adminv1.ListTeamsRequest{OrgId: o.GetId(), PageSize: size, PageToken: tok})
				return r.GetTeams(), r.GetNextPageToken(), err
			})
			if err != nil {
				return nil, fmt.Errorf("list teams of org %s: %w", org, err)
			}
			for _, t := range teams {
				st.teams[org+"/"+t.GetName()] = t
			}
		}
		if set.covered[kindUser] {
			users, err := collect(ctx, 0, func(ctx context.Context, size int32, tok string) ([]*adminv1.User, string, error) {
				r, err := call(ctx, cl.users.ListUsers, &adminv1.ListUsersRequest{OrgId: o.GetId(), PageSize: size, PageToken: tok})
				return r.GetUsers(), r.GetNextPageToken(), err
			})
			if err != nil {
				return nil, fmt.Errorf("list users of org %s: %w", org, err)
			}
			for _, u := range users {
				st.users[org+"/"+u.GetEmail()] = u
			}
		}
	}
	if err := loadTenants(ctx, cl, set, st); err != nil {
		return nil, err
	}
	if set.covered[kindModelGroup] {
		groups, err := listModelGroups(ctx, cl)
		if err != nil {
			return nil, err
		}
		for _, g := range groups {
			st.groups[g.GetName()] = g
		}
		// Lists carry no grants: one listing of every grant fills them in.
		grants, err := collect(ctx, 0, func(ctx context.Context, size int32, tok string) ([]*adminv1.ModelGroupGrant, string, error) {
			r, err := call(ctx, cl.models.ListModelGroupGrants, &adminv1.ListModelGroupGrantsRequest{PageSize: size, PageToken: tok})
			return r.GetGrants(), r.GetNextPageToken(), err
		})
		if err != nil && !permissionDenied(err) {
			return nil, fmt.Errorf("list model group grants: %w", err)
		}
		for _, gr := range grants {
			if g := st.groups[gr.GetModelGroup()]; g != nil {
				g.GrantedOrgIds = append(g.GrantedOrgIds, gr.GetOrgId())
			}
		}
		deps, err := listDeployments(ctx, cl, "")
		if err != nil {
			return nil, err
		}
		for _, d := range deps {
			st.deps[d.GetModelGroup()] = append(st.deps[d.GetModelGroup()], d)
		}
		// Traffic settings only of the deployments a document sets them for.
		withTraffic := map[string]bool{}
		for _, g := range set.groups {
			for i := range g.Deployments {
				if g.Deployments[i].Traffic != nil {
					withTraffic[g.Name+" "+g.Deployments[i].identity()] = true
				}
			}
		}
		st.groupTraffic = map[string]*adminv1.ModelGroupTraffic{}
		for _, g := range set.groups {
			if g.Traffic == nil || st.groups[g.Name] == nil {
				continue
			}
			r, err := call(ctx, cl.traffic.GetModelGroupTraffic, &adminv1.GetModelGroupTrafficRequest{ModelGroup: g.Name})
			if err != nil {
				return nil, fmt.Errorf("get traffic settings of model group %s: %w", g.Name, err)
			}
			st.groupTraffic[g.Name] = r.GetTraffic()
		}
		st.depTraffic = map[string]*adminv1.DeploymentTraffic{}
		for _, d := range deps {
			if !withTraffic[d.GetModelGroup()+" "+d.GetApiBase()+" "+d.GetUpstreamModel()] {
				continue
			}
			r, err := call(ctx, cl.traffic.GetDeploymentTraffic, &adminv1.GetDeploymentTrafficRequest{DeploymentId: d.GetId()})
			if err != nil {
				return nil, fmt.Errorf("get traffic settings of deployment %s: %w", d.GetId(), err)
			}
			st.depTraffic[d.GetId()] = r.GetTraffic()
		}
	}
	return st, nil
}

// permissionDenied reports whether err is the server's permission_denied.
func permissionDenied(err error) bool {
	var ae *apiError
	return errors.As(err, &ae) && ae.err.Code() == connect.CodePermissionDenied
}

func listModelGroups(ctx context.Context, cl *clients) ([]*adminv1.ModelGroup, error) {
	gs, err := collect(ctx, 0, func(ctx context.Context, size int32, tok string) ([]*adminv1.ModelGroup, string, error) {
		r, err := call(ctx, cl.models.ListModelGroups, &adminv1.ListModelGroupsRequest{PageSize: size, PageToken: tok})
		return r.GetModelGroups(), r.GetNextPageToken(), err
	})
	if err != nil {
		return nil, fmt.Errorf("list model groups: %w", err)
	}
	return gs, nil
}

func listDeployments(ctx context.Context, cl *clients, group string) ([]*adminv1.Deployment, error) {
	ds, err := collect(ctx, 0, func(ctx context.Context, size int32, tok string) ([]*adminv1.Deployment, string, error) {
		r, err := call(ctx, cl.models.ListDeployments, &adminv1.ListDeploymentsRequest{ModelGroup: group, PageSize: size, PageToken: tok})
		return r.GetDeployments(), r.GetNextPageToken(), err
	})
	if err != nil {
		return nil, fmt.Errorf("list deployments: %w", err)
	}
	return ds, nil
}

// orgNames are the orgs the file names: Org documents and the org of
// every Team and User document. Prune of teams and users is limited to
// these orgs.
func (s *docSet) orgNames() []string {
	seen := map[string]bool{}
	var out []string
	add := func(n string) {
		if !seen[n] {
			seen[n] = true
			out = append(out, n)
		}
	}
	for _, o := range s.orgs {
		add(o.Name)
	}
	for _, t := range s.teams {
		add(t.Org)
	}
	for _, u := range s.users {
		add(u.Org)
	}
	for _, o := range s.tenantOrgs() {
		add(o)
	}
	return out
}

// orgID is the id of org name, created earlier in this run or existing.
func (st *liveState) orgID(name string) (string, error) {
	if o := st.orgs[name]; o != nil {
		return o.GetId(), nil
	}
	return "", fmt.Errorf("org %q does not exist (declare it with kind: Org or create it first)", name)
}

// isEmpty reports whether m has no field set.
func isEmpty(m proto.Message) bool { return proto.Size(m) == 0 }

var compareJSON = protojson.MarshalOptions{UseProtoNames: true}

// onlyField is m with just field fd (an empty message counts as unset).
func onlyField(m protoreflect.Message, fd protoreflect.FieldDescriptor) protoreflect.Message {
	n := m.New()
	if m.Has(fd) {
		v := m.Get(fd)
		if fd.Kind() == protoreflect.MessageKind && !fd.IsList() && !fd.IsMap() && isEmpty(v.Message().Interface()) {
			return n
		}
		n.Set(fd, v)
	}
	return n
}

// diffFields compares the named top-level fields of cur and want: it
// returns the update-mask paths that differ and one line per differing
// leaf ("limits.rpm_limit: 10 → 20").
func diffFields(cur, want proto.Message, names ...string) ([]string, []string) {
	cm, wm := cur.ProtoReflect(), want.ProtoReflect()
	var paths, lines []string
	for _, name := range names {
		fd := cm.Descriptor().Fields().ByName(protoreflect.Name(name))
		a, b := onlyField(cm, fd), onlyField(wm, fd)
		ja, _ := compareJSON.Marshal(a.Interface())
		jb, _ := compareJSON.Marshal(b.Interface())
		if string(ja) == string(jb) {
			continue
		}
		paths = append(paths, name)
		lines = append(lines, rowDiff(a, b)...)
	}
	return paths, lines
}

// rowDiff is the FIELD: old → new lines between two messages.
func rowDiff(a, b protoreflect.Message) []string {
	var ra, rb [][2]string
	detailRows(a, "", &ra)
	detailRows(b, "", &rb)
	am, bm := map[string]string{}, map[string]string{}
	var keys []string
	for _, r := range ra {
		am[r[0]] = r[1]
		keys = append(keys, r[0])
	}
	for _, r := range rb {
		bm[r[0]] = r[1]
		if _, ok := am[r[0]]; !ok {
			keys = append(keys, r[0])
		}
	}
	var out []string
	for _, k := range keys {
		if am[k] == bm[k] {
			continue
		}
		out = append(out, fmt.Sprintf("%s: %s → %s", k, orUnset(am[k]), orUnset(bm[k])))
	}
	return out
}

func orUnset(s string) string {
	if s == "" {
		return "(unset)"
	}
	return s
}

// createLines lists the fields a new object gets.
func createLines(m proto.Message) []string {
	var rows [][2]string
	detailRows(m.ProtoReflect(), "", &rows)
	out := make([]string, 0, len(rows))
	for _, r := range rows {
		if r[1] == "" || r[1] == "false" || r[1] == "0" {
			continue
		}
		out = append(out, r[0]+": "+r[1])
	}
	return out
}

// plan compares the file with the live state and returns the changes in
// the order they must run: creates and updates by kind (orgs, model
// groups and deployments, teams, users), then with prune the deletions in
// the reverse order (deployments before their groups, users and teams
// before their orgs). An object that matches the file yields no change:
// re-applying an applied file makes no call that mutates.
func plan(st *liveState, set *docSet, prune bool) ([]change, error) {
	// Every org a team or user names must exist or be declared: checked
	// before anything changes, so a run never stops half-way on it.
	declared := map[string]bool{}
	for _, o := range set.orgs {
		declared[o.Name] = true
	}
	var missing []error
	for _, org := range set.orgNames() {
		if st.orgs[org] == nil && !declared[org] {
			missing = append(missing, fmt.Errorf("org %q does not exist and the file does not declare it (kind: Org)", org))
		}
	}
	if err := errors.Join(missing...); err != nil {
		return nil, err
	}
	var out []change
	for _, d := range set.orgs {
		want := &adminv1.Org{Name: d.Name, Limits: d.Limits.proto(), Metadata: d.Metadata}
		cur := st.orgs[d.Name]
		if cur == nil {
			out = append(out, change{"create", "Org " + d.Name, createLines(want), func(ctx context.Context, st *liveState) error {
				r, err := call(ctx, st.cl.orgs.CreateOrg, &adminv1.CreateOrgRequest{Name: want.Name, Limits: want.Limits, Metadata: want.Metadata})
				if err == nil {
					st.orgs[want.Name] = r.GetOrg()
				}
				return err
			}})
			continue
		}
		if paths, lines := diffFields(cur, want, "limits", "metadata"); len(paths) > 0 {
			want.Id = cur.GetId()
			out = append(out, change{"update", "Org " + d.Name, lines, func(ctx context.Context, st *liveState) error {
				_, err := call(ctx, st.cl.orgs.UpdateOrg, &adminv1.UpdateOrgRequest{Org: want, UpdateMask: &fieldmaskpb.FieldMask{Paths: paths}})
				return err
			}})
		}
	}
	for _, g := range set.groups {
		chs, err := planModelGroup(st, g, declared, prune)
		if err != nil {
			return nil, err
		}
		out = append(out, chs...)
	}
	for _, d := range set.teams {
		var tc adminv1.TrafficClass
		if d.TrafficClass != "" {
			tc, _ = parseTrafficClass(d.TrafficClass) // checked when decoded
		}
		want := &adminv1.Team{Name: d.Name, Limits: d.Limits.proto(), Metadata: d.Metadata, TrafficClass: tc, ModelGroupAliases: d.ModelGroupAliases}
		key := d.Org + "/" + d.Name
		cur := st.teams[key]
		if cur == nil {
			org := d.Org
			out = append(out, change{"create", "Team " + key, createLines(want), func(ctx context.Context, st *liveState) error {
				id, err := st.orgID(org)
				if err != nil {
					return err
				}
				r, err := call(ctx, st.cl.teams.CreateTeam, &adminv1.CreateTeamRequest{OrgId: id, Name: want.Name, Limits: want.Limits,
					Metadata: want.Metadata, TrafficClass: want.TrafficClass, ModelGroupAliases: want.ModelGroupAliases})
				if err == nil {
					st.teams[key] = r.GetTeam() // for the members and keys of the same run
				}
				return err
			}})
			continue
		}
		if paths, lines := diffFields(cur, want, "limits", "metadata", "traffic_class", "model_group_aliases"); len(paths) > 0 {
			want.Id = cur.GetId()
			out = append(out, change{"update", "Team " + key, lines, func(ctx context.Context, st *liveState) error {
				_, err := call(ctx, st.cl.teams.UpdateTeam, &adminv1.UpdateTeamRequest{Team: want, UpdateMask: &fieldmaskpb.FieldMask{Paths: paths}})
				return err
			}})
		}
	}
	for _, d := range set.users {
		want := &adminv1.User{Email: d.Email, DisplayName: d.DisplayName, Limits: d.Limits.proto(), Metadata: d.Metadata}
		key := d.Org + "/" + d.Email
		cur := st.users[key]
		if cur == nil {
			org := d.Org
			out = append(out, change{"create", "User " + key, createLines(want), func(ctx context.Context, st *liveState) error {
				id, err := st.orgID(org)
				if err != nil {
					return err
				}
				r, err := call(ctx, st.cl.users.CreateUser, &adminv1.CreateUserRequest{OrgId: id, Email: want.Email,
					DisplayName: want.DisplayName, Limits: want.Limits, Metadata: want.Metadata})
				if err == nil {
					st.users[key] = r.GetUser()
				}
				return err
			}})
			continue
		}
		if paths, lines := diffFields(cur, want, "display_name", "limits", "metadata"); len(paths) > 0 {
			want.Id = cur.GetId()
			out = append(out, change{"update", "User " + key, lines, func(ctx context.Context, st *liveState) error {
				_, err := call(ctx, st.cl.users.UpdateUser, &adminv1.UpdateUserRequest{User: want, UpdateMask: &fieldmaskpb.FieldMask{Paths: paths}})
				return err
			}})
		}
	}
	out = append(out, planTenants(st, set)...)
	if prune {
		out = append(out, planPruneTenants(st, set)...)
		out = append(out, planPrune(st, set)...)
	}
	return out, nil
}

// planModelGroup plans a model group, its grants and its deployments.
// Grants are planned when the document lists granted_orgs: to orgs that
// exist or the file declares (declared; created before the grant), and,
// with prune, revocations of grants the list leaves out. Deployments are
// matched by api_base and upstream_model; with prune, deployments of the
// group the file does not list are deleted.
func planModelGroup(st *liveState, g *modelGroupDoc, declared map[string]bool, prune bool) ([]change, error) {
	var out []change
	rt, err := g.Routing.proto()
	if err != nil {
		return nil, fmt.Errorf("ModelGroup %s: %w", g.Name, err)
	}
	want := &adminv1.ModelGroup{Name: g.Name, Description: g.Description, PlatformWide: g.PlatformWide, Routing: rt}
	if cur := st.groups[g.Name]; cur == nil {
		out = append(out, change{"create", "ModelGroup " + g.Name, createLines(want), func(ctx context.Context, st *liveState) error {
			_, err := call(ctx, st.cl.models.CreateModelGroup, &adminv1.CreateModelGroupRequest{Name: want.Name, Description: want.Description,
				PlatformWide: want.PlatformWide, Routing: want.Routing})
			return err
		}})
	} else if paths, lines := diffFields(cur, want, "description", "platform_wide", "routing"); len(paths) > 0 {
		out = append(out, change{"update", "ModelGroup " + g.Name, lines, func(ctx context.Context, st *liveState) error {
			_, err := call(ctx, st.cl.models.UpdateModelGroup, &adminv1.UpdateModelGroupRequest{ModelGroup: want, UpdateMask: &fieldmaskpb.FieldMask{Paths: paths}})
			return err
		}})
	}
	grants, err := planGrants(st, g, declared, prune)
	if err != nil {
		return nil, err
	}
	out = append(out, grants...)
	live := map[string]*adminv1.Deployment{}
	for _, d := range st.deps[g.Name] {
		live[d.GetApiBase()+" "+d.GetUpstreamModel()] = d
	}
	named := map[string]bool{}
	var traffic []change // deployments' traffic settings, after their updates
	for i := range g.Deployments {
		dd := &g.Deployments[i]
		named[dd.identity()] = true
		what := "Deployment " + g.Name + " " + dd.APIBase + " (" + dd.UpstreamModel + ")"
		wantDep := dd.proto(g.Name)
		wantTraffic, err := dd.trafficProto()
		if err != nil {
			return nil, fmt.Errorf("%s: %w", what, err)
		}
		cred := dd.Credential
		cur := live[dd.identity()]
		if cur == nil && cred != nil && cred.Stored {
			return nil, fmt.Errorf("%s: credential: stored: true, but the deployment does not exist yet: give valueFrom", what)
		}
		if cur == nil {
			lines := createLines(wantDep)
			if cred != nil {
				lines = append(lines, "credential: "+cred.describe())
			}
			if wantTraffic != nil {
				for _, l := range createLines(wantTraffic) {
					lines = append(lines, "traffic."+l)
				}
			}
			out = append(out, change{"create", what, lines, func(ctx context.Context, st *liveState) error {
				secret := ""
				if cred != nil {
					var err error
					if secret, err = cred.read(st.getenv); err != nil {
						return err
					}
				}
				r, err := call(ctx, st.cl.models.CreateDeployment, &adminv1.CreateDeploymentRequest{
					ModelGroup: g.Name, ApiBase: wantDep.ApiBase, UpstreamModel: wantDep.UpstreamModel, Credential: secret,
					Weight: wantDep.Weight, MaxConcurrency: wantDep.MaxConcurrency, Capabilities: wantDep.Capabilities,
					Tags: wantDep.Tags, Prices: wantDep.Prices, Free: wantDep.Free,
				})
				if err != nil || wantTraffic == nil {
					return err
				}
				_, err = call(ctx, st.cl.traffic.SetDeploymentTraffic, &adminv1.SetDeploymentTrafficRequest{
					DeploymentId: r.GetDeployment().GetId(), Traffic: wantTraffic})
				return err
			}})
			continue
		}
		if wantTraffic != nil {
			// After the deployments' own updates (a prefill cap or reserve
			// needs its max_concurrency first).
			curT, id := st.depTraffic[cur.GetId()], cur.GetId()
			if curT == nil {
				curT = &adminv1.DeploymentTraffic{}
			}
			ja, _ := compareJSON.Marshal(curT)
			jb, _ := compareJSON.Marshal(wantTraffic)
			if string(ja) != string(jb) {
				traffic = append(traffic, change{"update", "DeploymentTraffic " + g.Name + " " + dd.APIBase + " (" + dd.UpstreamModel + ")",
					rowDiff(curT.ProtoReflect(), wantTraffic.ProtoReflect()), func(ctx context.Context, st *liveState) error {
						_, err := call(ctx, st.cl.traffic.SetDeploymentTraffic, &adminv1.SetDeploymentTrafficRequest{DeploymentId: id, Traffic: wantTraffic})
						return err
					}})
			}
		}
		paths, lines := diffFields(cur, wantDep, deploymentDocPaths...)
		// A credential is sent when the deployment has none; one already
		// stored is kept (its value is never returned, so it cannot be
		// compared): rotate it with 'sluicectl deployment update'.
		setCred, removeCred := cred != nil && !cred.Stored && !cur.GetHasCredential(), cred == nil && cur.GetHasCredential()
		switch {
		case cred != nil && cred.Stored && !cur.GetHasCredential():
			return nil, fmt.Errorf("%s: credential: stored: true, but the deployment has no stored credential: give valueFrom", what)
		case setCred:
			lines = append(lines, "credential: none → "+cred.describe())
			paths = append(paths, "credential")
		case removeCred:
			lines = append(lines, "credential: stored → none")
			paths = append(paths, "credential")
		}
		if len(paths) == 0 {
			continue
		}
		wantDep.Id = cur.GetId()
		out = append(out, change{"update", what, lines, func(ctx context.Context, st *liveState) error {
			secret := ""
			if setCred {
				var err error
				if secret, err = cred.read(st.getenv); err != nil {
					return err
				}
			}
			_, err := call(ctx, st.cl.models.UpdateDeployment, &adminv1.UpdateDeploymentRequest{Deployment: wantDep,
				UpdateMask: &fieldmaskpb.FieldMask{Paths: paths}, Credential: secret})
			return err
		}})
	}
	out = append(out, traffic...)
	// The group's traffic settings after its deployments (their number
	// bounds prefill_isolation).
	wantGT, err := g.trafficProto()
	if err != nil {
		return nil, fmt.Errorf("ModelGroup %s: %w", g.Name, err)
	}
	if wantGT != nil {
		curGT := st.groupTraffic[g.Name]
		if curGT == nil {
			curGT = &adminv1.ModelGroupTraffic{}
		}
		ja, _ := compareJSON.Marshal(curGT)
		jb, _ := compareJSON.Marshal(wantGT)
		if string(ja) != string(jb) {
			out = append(out, change{"update", "ModelGroupTraffic " + g.Name, rowDiff(curGT.ProtoReflect(), wantGT.ProtoReflect()),
				func(ctx context.Context, st *liveState) error {
					_, err := call(ctx, st.cl.traffic.SetModelGroupTraffic, &adminv1.SetModelGroupTrafficRequest{ModelGroup: g.Name, Traffic: wantGT})
					return err
				}})
		}
	}
	if prune {
		var gone []*adminv1.Deployment
		for id, d := range live {
			if !named[id] {
				gone = append(gone, d)
			}
		}
		sort.Slice(gone, func(i, j int) bool { return gone[i].GetId() < gone[j].GetId() })
		for _, d := range gone {
			out = append(out, deleteDeployment(d))
		}
	}
	return out, nil
}

// planGrants plans the grants of g (planModelGroup). A grant's org id is
// resolved when it runs, so an org the same file creates can be granted.
func planGrants(st *liveState, g *modelGroupDoc, declared map[string]bool, prune bool) ([]change, error) {
	if g.GrantedOrgs == nil {
		return nil, nil
	}
	live := map[string]bool{}
	if cur := st.groups[g.Name]; cur != nil {
		for _, id := range cur.GetGrantedOrgIds() {
			name := st.orgName[id]
			if name == "" {
				name = id // an org the token cannot list: named by id
			}
			live[name] = true
		}
	}
	var out []change
	want := map[string]bool{}
	for _, org := range *g.GrantedOrgs {
		want[org] = true
		if live[org] {
			continue
		}
		if st.orgs[org] == nil && !declared[org] {
			return nil, fmt.Errorf("ModelGroup %s: granted_orgs: org %q does not exist and the file does not declare it (kind: Org)", g.Name, org)
		}
		out = append(out, change{"create", "Grant of ModelGroup " + g.Name + " to org " + org, nil, func(ctx context.Context, st *liveState) error {
			o := st.orgs[org]
			if o == nil {
				return fmt.Errorf("org %q was not created", org)
			}
			_, err := call(ctx, st.cl.models.GrantModelGroup, &adminv1.GrantModelGroupRequest{ModelGroup: g.Name, OrgId: o.GetId()})
			return err
		}})
	}
	if !prune {
		return out, nil
	}
	for _, org := range sortedKeys(live) {
		if want[org] {
			continue
		}
		id := org
		if o := st.orgs[org]; o != nil {
			id = o.GetId()
		}
		out = append(out, change{"delete", "Grant of ModelGroup " + g.Name + " to org " + org,
			[]string{"a revocation: the org's requests to the group stop on every data plane"}, func(ctx context.Context, st *liveState) error {
				_, err := call(ctx, st.cl.models.RevokeModelGroup, &adminv1.RevokeModelGroupRequest{ModelGroup: g.Name, OrgId: id})
				return err
			}})
	}
	return out, nil
}

// deploymentDocPaths are the deployment fields a document sets.
var deploymentDocPaths = []string{"weight", "max_concurrency", "capabilities", "tags", "prices", "free"}

func deleteDeployment(d *adminv1.Deployment) change {
	id := d.GetId()
	return change{"delete", "Deployment " + d.GetModelGroup() + " " + d.GetApiBase() + " (" + d.GetUpstreamModel() + ")", []string{"id: " + id},
		func(ctx context.Context, st *liveState) error {
			_, err := call(ctx, st.cl.models.DeleteDeployment, &adminv1.DeleteDeploymentRequest{Id: id})
			return err
		}}
}

// planPrune deletes what the file no longer names, per kind it covers:
// users and teams of the orgs it names, model groups (with their
// deployments) and orgs on the whole platform. Kinds the file has no
// document of are never pruned.
func planPrune(st *liveState, set *docSet) []change {
	var out []change
	if set.covered[kindModelGroup] {
		for _, name := range unnamed(set.groups, func(g *modelGroupDoc) string { return g.Name }, st.groups) {
			for _, d := range st.deps[name] {
				out = append(out, deleteDeployment(d))
			}
			out = append(out, change{"delete", "ModelGroup " + name, nil, func(ctx context.Context, st *liveState) error {
				_, err := call(ctx, st.cl.models.DeleteModelGroup, &adminv1.DeleteModelGroupRequest{Name: name})
				return err
			}})
		}
	}
	if set.covered[kindUser] {
		for _, key := range unnamed(set.users, func(u *userDoc) string { return u.Org + "/" + u.Email }, st.users) {
			out = append(out, deleteByID("User "+key, st.users[key].GetId(), func(ctx context.Context, st *liveState, id string) error {
				_, err := call(ctx, st.cl.users.DeleteUser, &adminv1.DeleteUserRequest{Id: id})
				return err
			}))
		}
	}
	if set.covered[kindTeam] {
		for _, key := range unnamed(set.teams, func(t *teamDoc) string { return t.Org + "/" + t.Name }, st.teams) {
			out = append(out, deleteByID("Team "+key, st.teams[key].GetId(), func(ctx context.Context, st *liveState, id string) error {
				_, err := call(ctx, st.cl.teams.DeleteTeam, &adminv1.DeleteTeamRequest{Id: id})
				return err
			}))
		}
	}
	if set.covered[kindOrg] {
		for _, name := range unnamed(set.orgs, func(o *orgDoc) string { return o.Name }, st.orgs) {
			out = append(out, deleteByID("Org "+name, st.orgs[name].GetId(), func(ctx context.Context, st *liveState, id string) error {
				_, err := call(ctx, st.cl.orgs.DeleteOrg, &adminv1.DeleteOrgRequest{Id: id})
				return err
			}))
		}
	}
	return out
}

// unnamed returns the keys of live, sorted, that no document of docs
// names (name: the key a document has in live): what a prune deletes.
func unnamed[D, L any](docs []D, name func(D) string, live map[string]L) []string {
	named := map[string]bool{}
	for _, d := range docs {
		named[name(d)] = true
	}
	var out []string
	for _, key := range sortedKeys(live) {
		if !named[key] {
			out = append(out, key)
		}
	}
	return out
}

// deleteByID is the change deleting the object what ("User acme/ada@x")
// of id with del; its plan line names the id.
func deleteByID(what, id string, del func(ctx context.Context, st *liveState, id string) error) change {
	return change{"delete", what, []string{"id: " + id}, func(ctx context.Context, st *liveState) error { return del(ctx, st, id) }}
}

func sortedKeys[V any](m map[string]V) []string {
	out := make([]string, 0, len(m))
	for k := range m {
		out = append(out, k)
	}
	sort.Strings(out)
	return out
}
