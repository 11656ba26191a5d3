% rebase('layout', title='Not found')
<section class="card narrow">
  <h1>Not found</h1>
  <p>There is no {{what}}. <a href="/console/">Back to Hardware</a></p>
</section>
